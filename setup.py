"""Build and install canonical-kv: the `layouts` package (pure Python)."""

from setuptools import find_packages, setup

setup(
    name="canonical-kv",
    version="0.1.0",
    description="Canonical, parallelism-free KV-cache pages moved by fused PyTorch ops",
    packages=find_packages(include=["layouts", "layouts.*"]),
    python_requires=">=3.10",
    install_requires=["numpy>=1.26"],
)
