"""README.md's examples run, on CPU inputs, and its set-up lines say what CI runs.

Each fenced ``python`` block is executed as written except for two substitutions, the same for every block:

- the string ``"cuda"`` becomes ``"cpu"`` (torch tensors and modules on the CPU), and
- ``import cupy`` becomes ``import numpy as cupy`` (the CuPy example's calls exist in NumPy with the same meaning).

CPU inputs take the float64 reference path, so these tests check that the examples are complete (every name
defined), call the API as it is, and give the shapes and kinds the README states; the GPU kernels are tested elsewhere.
"""
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _on_cpu(code: str) -> str:
    return code.replace('"cuda"', '"cpu"').replace("import cupy\n", "import numpy as cupy\n")


def _run(code: str) -> dict:
    """Run a block with torch's and NumPy's global generators seeded (the examples draw unseeded random inputs, and a
    bf16 example's error bound holds for typical draws: each run checks the same ones)."""
    try:
        import torch
        torch.manual_seed(0)
    except ImportError:
        pass
    np.random.seed(0)
    ns: dict = {"__name__": "readme_example"}
    exec(compile(_on_cpu(code), str(README), "exec"), ns)
    return ns


def _block(marker: str) -> str:
    found = [b for b in _blocks("python") if marker in b]
    assert len(found) == 1, f"README.md should have one python block containing {marker!r}"
    return found[0]


def test_every_python_block_is_covered():
    markers = ("torch.randn(2, 8, 256, 64", "cupy.random.default_rng", "class Model(nn.Module)", "loss.backward()",
               "window_size=(128, 0)", "merge_attention_states", "varlen_attention", "AttentionMod(")
    assert len(_blocks("python")) == len(markers)
    for marker in markers:
        _block(marker)


def test_torch_example(capsys):
    torch = pytest.importorskip("torch")
    code = _block("torch.randn(2, 8, 256, 64")
    assert code.count('device="cuda"') == 3  # the substitution is what makes it run here
    ns = _run(code)
    assert isinstance(ns["out"], torch.Tensor) and ns["out"].shape == (2, 8, 256, 64)
    assert ns["out"].dtype == torch.float16 and ns["lse"].shape == (2, 8, 256) and ns["lse"].dtype == torch.float32
    expect = torch.nn.functional.scaled_dot_product_attention(*(ns[n].double() for n in "qkv"), is_causal=True)
    assert (ns["out"].double() - expect).abs().max().item() < 2e-3
    assert "backend: reference" in capsys.readouterr().out


def test_training_example():
    torch = pytest.importorskip("torch")
    ns = _run(_block("loss.backward()"))
    grad = ns["qkv"].weight.grad
    assert grad is not None and grad.shape == (768, 256) and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert ns["out"].shape == (4, 4, 128, 64)


def test_cupy_example_with_numpy():
    code = _block("cupy.random.default_rng")
    assert "import cupy\n" in code
    ns = _run(code)
    out = ns["out"]
    assert isinstance(out, np.ndarray) and out.shape == (2, 8, 256, 64) and out.dtype == np.float16
    assert ns["keep"].dtype == np.bool_ and 0 < ns["keep"].mean() < 1


def test_variants_example():
    """The variants block: each call's out as the float64 reference gives it (the last one, ALiBi, checked here); the
    window as torch's SDPA with the equivalent boolean mask."""
    torch = pytest.importorskip("torch")
    from cupy_attn import reference
    code = _block("window_size=(128, 0)")
    ns = _run(code.replace("alibi_slopes=slopes)\n", "alibi_slopes=slopes)\nlast = out\n", 1))
    q, k, v = (ns[n].double().numpy() for n in "qkv")
    expect = reference.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                    alibi_slopes=ns["slopes"].numpy())
    assert ns["last"].shape == (1, 32, 512, 128) and ns["last"].dtype == torch.bfloat16
    np.testing.assert_allclose(ns["last"].double().numpy(), expect, atol=1e-2)
    i, j = torch.arange(512)[:, None], torch.arange(512)[None, :]
    window = torch.nn.functional.scaled_dot_product_attention(
        *(ns[n].double() for n in "qkv"), attn_mask=(j <= i) & (j >= i - 128), enable_gqa=True)
    got = ns["cupy_attn"].scaled_dot_product_attention(ns["q"], ns["k"], ns["v"], is_causal=True, enable_gqa=True,
                                                       window_size=(128, 0))
    assert (got.double() - window).abs().max().item() < 1e-2


def test_merge_example():
    """The merge block: the two halves' merge equals the whole call (float64 reference on the CPU)."""
    torch = pytest.importorskip("torch")
    import cupy_attn
    ns = _run(_block("merge_attention_states"))
    whole, whole_lse = cupy_attn.scaled_dot_product_attention(ns["q"], ns["k"], ns["v"], return_lse=True)
    assert ns["out"].shape == (2, 8, 16, 64) and ns["out"].dtype == torch.float16
    assert (ns["out"].float() - whole.float()).abs().max().item() < 2e-3
    assert (ns["lse"] - whole_lse).abs().max().item() < 1e-4


def test_varlen_example():
    """The packed-batch block: each sequence's rows equal the dense call on that sequence alone (bottom-right causal)."""
    torch = pytest.importorskip("torch")
    import cupy_attn
    ns = _run(_block("varlen_attention"))
    out, q, k, v = ns["out"], ns["q"], ns["k"], ns["v"]
    assert out.shape == (387, 8, 64) and out.dtype == torch.bfloat16
    rows = slice(100, 137)
    want = cupy_attn.scaled_dot_product_attention(q[rows].transpose(0, 1), k[rows].transpose(0, 1),
                                                  v[rows].transpose(0, 1), is_causal="bottom_right", enable_gqa=True)
    assert (out[rows].float() - want.transpose(0, 1).float()).abs().max().item() < 1e-2


def test_mods_example():
    """The mods block (float64 reference on the CPU): the document mask equals the same call with the bool mask it
    spells (with and without its block mask), the bias table's score_mod the call with that bias as a float mask,
    the ALiBi mod the built-in alibi_slopes, and the prefix-LM mask_mod its bool mask."""
    torch = pytest.importorskip("torch")
    import cupy_attn
    ns = _run(_block("AttentionMod("))
    q, k, v, doc, table = ns["q"], ns["k"], ns["v"], ns["doc"], ns["table"]
    mask = (doc[:, None, :, None] == doc[:, None, None, :]) & torch.ones(1024, 1024, dtype=torch.bool).tril()
    first = cupy_attn.scaled_dot_product_attention(q[:, :2], k[:, :2], v[:, :2], mask, score_mod=None)
    got = cupy_attn.scaled_dot_product_attention(q[:, :2], k[:, :2], v[:, :2], is_causal=True,
                                                 score_mod=ns["same_document"], aux={"doc": doc})
    assert (got.float() - first.float()).abs().max().item() < 1e-3
    dist = (torch.arange(1024)[:, None] - torch.arange(1024)[None]).abs().clamp(max=63)
    bias = table[:, dist].to(torch.float16)  # (8, 1024, 1024)
    want = cupy_attn.scaled_dot_product_attention(q, k, v, bias.float())
    assert ns["block_mask"].ranges.shape == (2, 1, 8, 4)
    assert (ns["block_mask_out"].float() - got_full(cupy_attn, ns).float()).abs().max().item() < 1e-3
    bias_out = cupy_attn.scaled_dot_product_attention(q, k, v, score_mod=ns["relative_bias"], aux={"table": table})
    assert bias_out.shape == (2, 8, 1024, 128) and (bias_out.float() - want.float()).abs().max().item() < 1e-2
    alibi = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=ns["alibi"],
                                                   aux={"slopes": ns["slopes"]})
    builtin = cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, alibi_slopes=ns["slopes"])
    assert (alibi.float() - builtin.float()).abs().max().item() < 1e-3  # L = S: |i - j| is ALiBi's distance
    i, j = torch.arange(1024)[:, None], torch.arange(1024)[None]
    prefix_mask = (j <= i)[None, None] | (j[None, None] < ns["prefix"].long()[:, None, None, None])
    want = cupy_attn.scaled_dot_product_attention(q, k, v, prefix_mask)
    assert (ns["out"].float() - want.float()).abs().max().item() < 1e-3


def got_full(cupy_attn, ns):
    """The block-mask call's result without the block mask (the same function)."""
    return cupy_attn.scaled_dot_product_attention(ns["q"], ns["k"], ns["v"], is_causal=True,
                                                  score_mod=ns["same_document"], aux={"doc": ns["doc"]})


def test_module_example():
    torch = pytest.importorskip("torch")
    code = _block("class Model(nn.Module)")
    assert code.count('"cuda"') == 2
    ns = _run(code)
    probs = ns["probs"]
    assert isinstance(probs, torch.Tensor) and probs.shape == (128, 256) and probs.dtype == torch.float16
    assert torch.allclose(probs.double().sum(dim=1), torch.ones(128, dtype=torch.float64), atol=1e-2)
    fused = ns["fused"]
    assert not fused.training and list(fused.state_dict()) == list(ns["plain_model"].state_dict())
    check = ns["Model"](512, 256).double()   # the functional call (eval, scale 2.0) against the plain model in float64
    check.load_state_dict(fused.state_dict())
    check.eval()
    with torch.no_grad():
        check.scale.fill_(2.0)
        expect = check(ns["x"].double())
    assert (probs.double() - expect).abs().max().item() < 2e-3


def _setup_blocks() -> dict[str, list[str]]:
    """The set-up section's bash blocks by the case they serve ("No GPU", "CUDA 12", "CUDA 13"): their commands."""
    section = README.read_text().split("## Set-up\n", 1)[1].split("\n## ", 1)[0]
    blocks = {}
    for intro, block in re.findall(r"^(.*?):\n\n```bash\n(.*?)^```", section, flags=re.S | re.M):
        case = next(c for c in ("No GPU", "CUDA 12", "CUDA 13") if c in intro.splitlines()[-1])
        blocks[case] = block.splitlines()
    assert list(blocks) == ["No GPU", "CUDA 12", "CUDA 13"]
    return blocks


def test_setup_lines():
    """.ci/run runs the lines tagged "# torch, no GPU", "# main job" and "# tests", in that order, which are the
    no-GPU block's three lines in the README's order: torch first (so the main job cross-checks the reference), from
    PyTorch's CPU index only (no index that offers PyPI's CUDA build); the tests command installs no torch (a GPU
    user's stays)."""
    blocks = _setup_blocks()
    tags = [line.split("  # ", 1) for line in blocks["No GPU"]]
    assert [tag for _, tag in tags] == ["torch, no GPU", "main job", "tests"]
    lines = {tag: command for command, tag in tags}
    assert "bench/main.py" in lines["main job"] and '".[cuda12]"' in lines["main job"]
    tests = lines["tests"]
    assert "pytest" in tests and "torch" not in tests and '".[cuda12,test]"' in tests
    cpu = lines["torch, no GPU"].split()
    assert cpu[:3] == ["pip", "install", "torch==2.13.0"] and "--extra-index-url" not in cpu
    assert cpu[cpu.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    ci = (README.parent / ".ci" / "run").read_text()
    order = [ci.index(f'readme_command "{tag}"') for tag in ("torch, no GPU", "main job", "tests")]
    runs = [ci.index(f'bash -c "${name}"') for name in ("cpu_torch", "main_job", "tests")]
    assert order == sorted(order) and runs == sorted(runs)


def test_setup_blocks_for_a_gpu():
    """Each GPU block: its torch line first (CUDA 12: a CUDA 12 index of PyTorch's; CUDA 13: PyPI's, whose build is
    for CUDA 13), then the no-GPU block's main job and tests commands with that block's CUDA extra."""
    blocks = _setup_blocks()
    main_job, tests = (line.split("  # ")[0] for line in blocks["No GPU"][1:])
    for case, extra in (("CUDA 12", "cuda12"), ("CUDA 13", "cuda13")):
        torch_line, *rest = blocks[case]
        assert rest == [main_job.replace("cuda12", extra), tests.replace("cuda12", extra)]
        assert torch_line.split()[:3] == ["pip", "install", "torch==2.13.0"]
    assert "https://download.pytorch.org/whl/cu12" in blocks["CUDA 12"][0]
    assert blocks["CUDA 13"][0] == "pip install torch==2.13.0"


@pytest.mark.gpu
@pytest.mark.parametrize("marker", ["torch.randn(2, 8, 256, 64", "cupy.random.default_rng", "class Model(nn.Module)",
                                    "window_size=(128, 0)", "merge_attention_states", "varlen_attention"])
def test_examples_as_written_on_the_gpu(marker):
    """On a GPU the blocks run unchanged (CUDA tensors, CuPy arrays, the fused paths)."""
    if marker != "cupy.random.default_rng":
        pytest.importorskip("torch")
    ns: dict = {"__name__": "readme_example"}
    exec(compile(_block(marker), str(README), "exec"), ns)
    out = ns["probs"] if "probs" in ns else ns["out"]
    assert tuple(out.shape) in ((2, 8, 256, 64), (128, 256), (1, 32, 512, 128), (2, 8, 16, 64), (387, 8, 64))
