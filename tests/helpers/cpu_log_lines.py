"""What vLLM and PyTorch log on a machine without a GPU; the README's Quick start explains each."""

CPU_LOG_LINES = (
    "No CUDA runtime is found, using CUDA_HOME=",
    "Triton is installed but 0 active driver(s) found (expected 1).",
    "Triton not installed or not compatible; certain GPU-related functions will not be available.",
    "Failed to import from vllm._C: ImportError('libcuda.so.1: cannot open shared object file:",
)
