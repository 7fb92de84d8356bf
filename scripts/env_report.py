"""Print the Python and the training stack of the environment it runs in (``mlflow run . -e env``):
what MLflow built from python_env.yaml, checked without training anything."""

from __future__ import annotations

import importlib.metadata
import platform

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "mlflow", "vllm", "unsloth")


def main() -> int:
    print(f"python {platform.python_version()} ({platform.machine()})")
    for name in PACKAGES:
        try:
            print(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{name} not installed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
