"""Multi-process runs for the cupy_attn.distributed tests: spawn the ranks, and report every rank's failure."""
import contextlib


def spawn(worker, world: int, tmp_path, *args) -> None:
    """Run ``worker(rank, world, init, failures, *args)`` in ``world`` spawned processes (a file rendezvous under
    tmp_path: ``init`` for init_process_group); AssertionError with each failed rank's message when any fails."""
    import torch.multiprocessing as mp
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(worker, args=(world, f"file://{tmp_path / 'rendezvous'}", failures, *args), nprocs=world,
                           join=True, start_method="spawn")
    except Exception:
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        raise AssertionError("; ".join(messages) or "a worker failed") from None


@contextlib.contextmanager
def rank_errors(rank: int, failures):
    """A worker's body: an exception is reported (rank, type, message) and re-raised; the process group is destroyed
    on the way out."""
    import torch.distributed as dist
    try:
        yield
    except Exception as exc:
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
