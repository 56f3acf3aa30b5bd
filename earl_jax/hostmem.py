"""The host: glibc's malloc on transparent huge pages for the launchers, and the CPU a run or a
benchmark ran on (``cpu_description``, printed in their headers).

XLA:CPU allocates every large buffer of a program (activations, gradients, the temp arena) with
the host's malloc on each call, and glibc gives freed memory back to the kernel (blocks over its
mmap threshold are unmapped; the heaps of the threads' arenas shrink), so the kernel faults the
pages in again on the next call, 4 KiB at a time, and zeroes them: one update step of a
34M-parameter model on one CPU device (batch 32 x 288 tokens, float32) took 1.5 million page
faults. On VMs that report freed memory to the hypervisor, each such fault after an idle spell
costs more (``benchmarks/peers.py``'s docstring). Keeping the memory in glibc instead
(``glibc.malloc.mmap_max=0`` and a trim threshold of 10**12, with huge pages) took the kernel time
of that step from 2-3 s to 0.1 s in one order of programs, but raised the peak resident memory from
8.4 to 14.1 GB, and in another order the step still took 3.3 s of kernel time: not used. With
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` malloc asks for transparent huge pages
(``madvise(MADV_HUGEPAGE)``), 2 MiB per fault: measured on 2 cores, 8 thousand faults and
7.1-7.8 s instead of 9.2-10.7 s for that step repeated, 6.1-6.4 s instead of 6.8-7.4 s in
micro-batches of 8 rows, the same peak resident memory; with generate, reference and update
taking turns in one process, as in the trainer, 10.1-11.7 s instead of 11.3-13.4 s.
``benchmarks/peers.py --allocator thp`` starts both of its sides so.

glibc reads its tunables once, when the process starts, so ``launch/train.py`` re-executes
itself with the tunable added before it imports JAX (``thp_environ``). Nothing is changed when
the user already set ``glibc.malloc.hugetlb``, when the C library is not glibc 2.35 or newer (the
first with the tunable), or when the kernel has transparent huge pages off.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)


def setting(environ: Mapping[str, str]) -> str | None:
  """The value of ``glibc.malloc.hugetlb`` in ``environ``'s GLIBC_TUNABLES, None when unset."""
  for tunable in environ.get("GLIBC_TUNABLES", "").split(":"):
    name, _, value = tunable.partition("=")
    if name == TUNABLE:
      return value
  return None


def thp_environ(
  environ: Mapping[str, str],
  *,
  libc: tuple[str, str] | None = None,
  thp_sysfs: str = THP_SYSFS,
) -> dict[str, str] | None:
  """The environment to re-execute with so malloc uses transparent huge pages, or None when
  there is nothing to do (see the module docstring); ``libc`` defaults to this process's."""
  if setting(environ) is not None:
    return None  # the user's choice (or ours, after the re-exec) stands
  name, version = libc if libc is not None else platform.libc_ver()
  try:
    numbers = tuple(int(x) for x in version.split(".")[:2])
  except ValueError:
    return None
  if name != "glibc" or numbers < MIN_GLIBC:
    return None
  try:
    with open(thp_sysfs) as f:
      if "[never]" in f.read():
        return None
  except OSError:
    return None  # no transparent huge pages in this kernel
  tunables, ours = environ.get("GLIBC_TUNABLES", ""), f"{TUNABLE}=1"
  return {**environ, "GLIBC_TUNABLES": f"{tunables}:{ours}" if tunables else ours}


def wanted(argv: list[str], flag: str = "host_thp") -> bool:
  """The launcher's boolean ``--host_thp`` as absl will parse it (default on), read before absl
  runs: ``--nohost_thp`` or ``--host_thp=false`` turn it off."""
  on = True
  for arg in argv[1:]:
    if arg == f"--no{flag}":
      on = False
    elif arg == f"--{flag}":
      on = True
    elif arg.startswith(f"--{flag}="):
      on = arg.split("=", 1)[1].lower() in ("1", "true", "t")
  return on


def reexec_with_thp() -> None:
  """Replaces this process with itself (same interpreter, flags and arguments, same PID) under
  ``thp_environ``'s environment; returns only when there is nothing to do."""
  env = thp_environ(os.environ)
  if env is None or sys.platform != "linux" or not sys.executable:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)


def malloc_description(environ: Mapping[str, str] = os.environ) -> str:
  """One line for the run's header: the malloc page setting this process started with."""
  value = setting(environ)
  if value is None:
    return f"host malloc: the C library's default pages ({TUNABLE} not set)"
  what = {"0": "off", "1": "transparent huge pages", "2": "hugetlbfs pages"}.get(value, "?")
  return f"host malloc: {TUNABLE}={value} ({what})"


def cpu_description(cpuinfo: str | None = None) -> str:
  """The host CPU's model name, family and model numbers and widest x86 vector extension, read
  off /proc/cpuinfo (``cpuinfo``: its text, for tests): CPU timings depend on them (XLA:CPU's and
  torch's kernels use AVX-512 differently; a VM's model name can be as bare as "AMD EPYC"), so
  the trainer's header and every benchmark table name the CPU they ran on."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    except OSError:
      return platform.processor() or platform.machine()
  fields = {}
  for line in cpuinfo.splitlines():
    if not line.strip():
      break  # the first processor's block is enough
    key, sep, value = line.partition(":")
    if sep:
      fields[key.strip()] = value.strip()
  model = fields.get("model name", platform.machine())
  if "cpu family" in fields:
    model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
  flags = set(fields.get("flags", "").split())
  isa = next((x for x in ("avx512f", "avx2", "avx") if x in flags), "")
  return f"{model}, {isa}" if isa else model


def host_line() -> str:
  """One header line: the CPU (``cpu_description``) and the cores this process may run on."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"host: {cpu_description()}, {cores} cores"
