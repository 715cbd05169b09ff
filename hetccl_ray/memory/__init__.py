"""Where bytes live: host, device (CUDA, ROCm) and emulated device memory, and scratch."""
