"""Build and install titan_kernels (the op library) and trainer (Llama 3 pre-training).

The native extension in csrc/ is optional; see csrc/ and the README for how it is built.
"""
import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
from setup_native import native_build  # noqa: E402  (the optional C++/CUDA extension; see its docstring)

setup(
    name="titan-kernels",
    version="0.1.0",
    description="Fused kernels (RMSNorm, rotary, float8, FlashAttention) and a PyTorch-native Llama 3 trainer",
    python_requires=">=3.10",
    packages=find_packages(include=["titan_kernels", "titan_kernels.*", "trainer", "trainer.*"]),
    package_data={"trainer": ["configs/*/*.toml", "data/samples/*.jsonl"]},
    install_requires=[
        # triton is not required: the CUDA builds of torch bring their own, and without it every op runs
        # on its other backends (titan_kernels.available_backends() says why triton is unavailable).
        "torch>=2.11",
        "numpy",
        "tokenizers>=0.19",
        "tiktoken>=0.7",
        "sentencepiece>=0.2",
        "tensorboard>=2.15",
        "matplotlib>=3.7",  # metrics.png at the end of a run, python -m trainer.plot
        "pyarrow>=14",
        "psutil>=5.9",
        "safetensors>=0.4",  # Hugging Face checkpoints (trainer.hf, trainer.convert)
        "xxhash>=3",  # checkpoint manifests: a checksum per file (trainer.checkpoint.manifest)
        "filelock>=3.12",  # one run per dump folder (trainer.run.folder)
        "tomli>=1.1; python_version < '3.11'",
    ],
    extras_require={
        # triton for the tests of the Triton kernels in its interpreter (TRITON_INTERPRET=1) on the CPU.
        "test": ["pytest>=8", "pytest-benchmark>=4", "pytest-timeout>=2", "pytest-xdist>=3", "expecttest", "ninja",
                 "triton>=3.6; platform_system == 'Linux'",
                 "transformers>=4.45", "wandb>=0.19", "diffusers>=0.32",
                 "torchft==0.2.0; python_version == '3.11' and platform_system == 'Linux'"],
        "triton": ["triton>=3.6; platform_system == 'Linux'"],  # the interpreter with a CPU-only torch
        "ft": ["torchft==0.2.0"],  # replica-group fault tolerance (trainer.run.fault_tolerance)
        "wandb": ["wandb>=0.19"],
        "hf": ["datasets>=2.18"],
        "float8": ["torchao>=0.10"],
        "flux": ["transformers>=4.45", "diffusers>=0.32", "pillow"],  # Flux's encoders, autoencoder, images
    },
    **native_build(),
)
