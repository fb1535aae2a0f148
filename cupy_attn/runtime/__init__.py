"""What every operation uses: interop (arrays in and out, streams), compile (NVRTC, kernel families, caches),
callcache (replaying prepared calls), blas / cublaslt (GEMMs)."""
