"""The second CPU setting the test command checks the notebooks under: kernels other than the
ones torch and MKL pick on this machine, so that a compared output tied to one vector unit fails
here rather than on a learner's laptop or GitHub's runner.

torch reads ATEN_CPU_CAPABILITY once, at import, to choose its vectorised kernels (avx512, avx2 or
default, i.e. none); MKL reads MKL_ENABLE_INSTRUCTIONS for its matrix kernels. Rounding, and so
the bits of any trained weight, follow them. `python tests/other_cpu.py` prints the variables to
set (`KEY=VALUE ...`), or nothing where this CPU has no second setting.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

_BY_ACTIVE = {
    # what torch uses now -> a different setting that every CPU of that kind can run
    "AVX512": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "AVX2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def other_setting() -> dict[str, str]:
    """Environment variables that make torch and MKL use other kernels than they use now."""
    active = torch.backends.cpu.get_cpu_capability()
    if active in _BY_ACTIVE:
        return dict(_BY_ACTIVE[active])
    if active == "DEFAULT" and "avx2" in _cpu_flags():
        return {"ATEN_CPU_CAPABILITY": "avx2"}  # forced to default here: the vector unit instead
    if active.startswith("SVE"):
        return {"ATEN_CPU_CAPABILITY": "default"}  # aarch64 with SVE: NEON kernels instead
    return {}


def _cpu_flags() -> set[str]:
    if platform.system() != "Linux":
        return set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


if __name__ == "__main__":
    print(" ".join(f"{k}={v}" for k, v in other_setting().items()))
