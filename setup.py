"""Build canonical-kv: `layouts` (pure Python) and `canonical_ops` with its extension `_C`.

The extension always gets the CPU kernels. It gets the CUDA kernels whenever
nvcc and a CUDA build of torch are present (no GPU needed to compile); set
CANONICAL_KV_BUILD_CUDA=0 to skip them or =1 to insist. TORCH_CUDA_ARCH_LIST
defaults to "8.0+PTX;9.0": SASS for A100 and H100/H200 and sm_80 PTX, which the
driver JIT-compiles once for any newer GPU (L40S, B200, ...), so every GPU from
sm_80 up runs the same build; make_plan refuses, with the reason, a GPU the build
has no image for.
"""

import os
import platform
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> tuple[bool, str]:
    import torch
    from torch.utils import cpp_extension

    choice = os.environ.get("CANONICAL_KV_BUILD_CUDA", "auto").lower()
    if choice in ("0", "no", "off", "false"):
        return False, "CANONICAL_KV_BUILD_CUDA=0"
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} is not a CUDA build"
    elif cpp_extension.CUDA_HOME is None or not (
        shutil.which("nvcc") or os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    ):
        reason = "nvcc not found (set CUDA_HOME)"
    else:
        return True, f"nvcc in {cpp_extension.CUDA_HOME}, torch CUDA {torch.version.cuda}"
    if choice in ("1", "yes", "on", "true"):
        raise RuntimeError(f"CANONICAL_KV_BUILD_CUDA=1 but {reason}")
    return False, reason


DEFAULT_CUDA_ARCH_LIST = "8.0+PTX;9.0"


def _arch_list_macro(arch_list: str) -> str:
    """The arch list as preprocessor tokens (stringified in C++), e.g. 8.0+PTX/9.0: no ';',
    spaces or commas, which shells and nvcc's -D would split on."""
    return "/".join(part for part in arch_list.replace(";", " ").replace(",", " ").split())


def _extensions():
    from torch.utils import cpp_extension

    use_cuda, why = _want_cuda()
    include = [os.path.join(ROOT, "kernels", "include")]
    sources = [
        "kernels/registration.cpp",
        "kernels/validation.cpp",
        "kernels/settings.cpp",
        "kernels/cpu/canonical_cpu.cpp",
    ]
    # torch picks the C++ standard its headers need. -fno-wrapv undoes the -fwrapv that
    # Python's CFLAGS add: with it, GCC compiles the CPU copy loop ~20% slower.
    cxx = ["-O3", "-fno-wrapv"]
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is inline OpenMP: without -fopenmp it silently runs serially. Linking
        # -fopenmp resolves libgomp.so.1, the runtime torch has already loaded (one thread pool).
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)
        sources += [
            "kernels/plan_registry.cpp",
            "kernels/cuda/canonical_cuda.cpp",
            "kernels/cuda/canonical_kernel.cu",
        ]
        print(
            f"canonical-kv: building CPU + CUDA kernels ({why}; "
            f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})"
        )
        return [
            cpp_extension.CUDAExtension(
                "canonical_ops._C",
                sources,
                include_dirs=include,
                define_macros=[("CANONICAL_WITH_CUDA", "1")],
                extra_compile_args={
                    "cxx": [
                        *cxx,
                        "-DCANONICAL_CUDA_ARCH_TOKENS="
                        + _arch_list_macro(os.environ["TORCH_CUDA_ARCH_LIST"]),
                    ],
                    "nvcc": ["-O3", "-lineinfo"],
                },
                extra_link_args=link,
            )
        ]
    print(f"canonical-kv: building CPU kernels only ({why})")
    return [
        cpp_extension.CppExtension(
            "canonical_ops._C",
            sources,
            include_dirs=include,
            extra_compile_args=cxx,
            extra_link_args=link,
        )
    ]


def _unitio():
    """canonical_ops._unitio: FileStore's batch unit I/O (plain CPython C API, no torch, so
    canonical_ops.units imports it in any venv of the same Python), with xxHash vendored
    (kernels/third_party/xxhash, BSD-2; run-time dispatch to AVX-512 / AVX2 on x86)."""
    from setuptools import Extension

    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    sources = ["kernels/unitio/unitio.cpp"]
    if x86:
        sources.append("kernels/third_party/xxhash/xxh_x86dispatch.c")
    flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wno-maybe-uninitialized"]
    return Extension(
        "canonical_ops._unitio",
        sources,
        include_dirs=[os.path.join(ROOT, "kernels", "third_party", "xxhash")],
        extra_compile_args=flags,
    )


def _build_ext():
    from torch.utils import cpp_extension

    return cpp_extension.BuildExtension.with_options(use_ninja=True, no_python_abi_suffix=False)


setup(
    name="canonical-kv",
    version="0.1.0",
    description="Canonical, parallelism-free KV-cache pages moved by fused PyTorch ops",
    packages=find_packages(include=["layouts", "layouts.*", "canonical_ops", "canonical_ops.*"]),
    python_requires=">=3.10",
    install_requires=["numpy>=1.26", "torch>=2.6", "xxhash>=3.4"],
    extras_require={"redis": ["redis>=5"]},
    ext_modules=[*_extensions(), _unitio()],
    # vLLM loads general plugins at start-up: this registers CanonicalOffloadingSpec.
    entry_points={"vllm.general_plugins": ["canonical_kv = canonical_ops.vllm:register"]},
    cmdclass={"build_ext": _build_ext()},
)
