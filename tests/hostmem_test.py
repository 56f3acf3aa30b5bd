"""earl_jax.hostmem: when the launcher re-executes itself on transparent huge pages."""

import os
import subprocess
import sys

from earl_jax import hostmem


def _sysfs(tmp_path, text: str) -> str:
  path = tmp_path / "enabled"
  path.write_text(text)
  return str(path)


def test_thp_environ_adds_the_tunable_and_keeps_the_users(tmp_path):
  sysfs = _sysfs(tmp_path, "always [madvise] never\n")
  env = hostmem.thp_environ({"A": "1"}, libc=("glibc", "2.36"), thp_sysfs=sysfs)
  assert env == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
  env = hostmem.thp_environ(other, libc=("glibc", "2.35"), thp_sysfs=sysfs)
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_thp_environ_leaves_alone_what_it_should(tmp_path):
  madvise = _sysfs(tmp_path, "always [madvise] never\n")
  for value in ("0", "1", "2"):  # the user's (or an earlier re-exec's) setting stands
    env = {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:glibc.malloc.hugetlb={value}"}
    assert hostmem.thp_environ(env, libc=("glibc", "2.36"), thp_sysfs=madvise) is None
  for libc in (("glibc", "2.34"), ("musl", "1.2"), ("", ""), ("glibc", "x.y")):
    assert hostmem.thp_environ({}, libc=libc, thp_sysfs=madvise) is None, libc
  never = str(tmp_path / "never")
  with open(never, "w") as f:
    f.write("always madvise [never]\n")
  assert hostmem.thp_environ({}, libc=("glibc", "2.36"), thp_sysfs=never) is None
  missing = str(tmp_path / "absent")
  assert hostmem.thp_environ({}, libc=("glibc", "2.36"), thp_sysfs=missing) is None


def test_wanted_reads_the_flag_as_absl_does():
  assert hostmem.wanted(["train.py"])
  assert hostmem.wanted(["train.py", "--host_thp"])
  assert not hostmem.wanted(["train.py", "--nohost_thp"])
  assert not hostmem.wanted(["train.py", "--host_thp=false"])
  assert not hostmem.wanted(["train.py", "--host_thp=0"])
  assert hostmem.wanted(["train.py", "--nohost_thp", "--host_thp=true"])  # the last one wins
  assert hostmem.wanted(["train.py", "--config.host_thp=0"])  # another flag


def test_malloc_description_names_the_setting():
  assert "transparent huge pages" in hostmem.malloc_description(
    {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
  )
  assert "(off)" in hostmem.malloc_description({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
  assert "not set" in hostmem.malloc_description({})


# /proc/cpuinfo, trimmed: a VM's bare AMD name in two processor blocks (only the first may be
# read), and an Intel without AVX-512.
AMD_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""
INTEL = """processor\t: 0
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_cpu_description_names_model_family_and_widest_avx():
  assert hostmem.cpu_description(AMD_VM) == "AMD EPYC (family 25, model 17), avx512f"
  assert (
    hostmem.cpu_description(INTEL) == "Intel(R) Xeon(R) CPU @ 2.20GHz (family 6, model 85), avx2"
  )
  bare = hostmem.cpu_description("model name\t: Some ARM core\nFeatures\t: fp asimd\n")
  assert bare == "Some ARM core"  # no family line, no x86 flags: the name alone
  line = hostmem.host_line()  # this machine's, with the cores this process may use
  assert line.startswith("host: ") and line.endswith(f"{len(os.sched_getaffinity(0))} cores")


def test_reexec_replaces_the_process_once_with_the_tunable():
  """A real re-exec: the same PID comes back with the tunable, and only once."""
  code = (
    "import os, sys\n"
    "from earl_jax import hostmem\n"
    "print(os.getpid(), os.environ.get('GLIBC_TUNABLES', '-'), flush=True)\n"
    "hostmem.reexec_with_thp()\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 0, out.stderr
  lines = [line.split() for line in out.stdout.splitlines()]
  if hostmem.thp_environ(env) is None or sys.platform != "linux":
    assert lines == [[lines[0][0], "-"]]  # nothing to do on this host: no re-exec
  else:
    assert lines == [[lines[0][0], "-"], [lines[0][0], "glibc.malloc.hugetlb=1"]]
