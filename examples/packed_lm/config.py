"""The run's settings: one dataclass, its command-line flags, and the
platform set-up that must happen before jax starts (no jax import here)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Sequence

CPU_DP, CPU_CP = 2, 4   # the CPU default mesh (8 virtual devices)
REMAT = ("none", "save_context", "minimal", "minimal_with_context", "full",
         "offload_context")


def _flag(default, help_: str, type_=None, choices=None):
  return dataclasses.field(default=default, metadata=dict(
      help=help_, type=type_, choices=choices))


@dataclasses.dataclass
class Config:
  """Every setting of a run; each field is the flag ``--field-name``.

  Defaults that depend on other fields (``dtype``, ``lr``, ``warmup``,
  ``max_doc_len``, and ``doc_order`` for DUAL_CHUNK_SWAP) are filled in
  when the config is built; ``dp`` and ``cp`` once the devices are known
  (:func:`choose_mesh_shape`).
  """

  device: str = _flag("cpu", "platform", choices=("cpu", "gpu"))
  dtype: str | None = _flag(None, "computation dtype (default: bfloat16 "
                            "with --device gpu, float32 on CPU)", str,
                            ("float32", "bfloat16"))
  layers: int = _flag(2, "transformer layers")
  d_model: int = _flag(128, "model width")
  heads: int = _flag(4, "query heads")
  kv_heads: int = _flag(2, "key/value heads")
  seq_len: int = _flag(512, "tokens per row")
  batch: int = _flag(2, "rows per step")
  dp: int | None = _flag(None, "data-parallel size (default: 2 on CPU; on "
                         "GPU, devices / cp, else 1)", int)
  cp: int | None = _flag(None, "context-parallel size (default: 4 on CPU; on"
                         " GPU, the devices present / dp)", int)
  steps: int = _flag(100, "training steps")
  lr: float | None = _flag(None, "peak learning rate (default: min(3e-3, "
                           "0.6/d_model))", float)
  warmup: int | None = _flag(None, "linear warmup steps (default: 10%% of "
                             "--steps, at most 100)", int)
  param_sharding: str = _flag("fsdp", "parameters and optimizer state: "
                              "sharded over data x cp, or one copy per "
                              "device", choices=("fsdp", "replicated"))
  remat: str = _flag("none", "rematerialisation of every layer (the "
                     "library's TransformerLayer remat presets)",
                     choices=REMAT)
  prefetch: int = _flag(2, "batches built ahead on a host thread (0: none)")
  log_every: int = _flag(10, "the host waits for the device (loss, progress"
                         " bar) every this many steps")
  peak_tflops: float | None = _flag(None, "device peak TFLOP/s for the MFU "
                                    "(default: the bf16 dense peak of known "
                                    "GPUs)", float)
  seed: int = _flag(0, "seed of the parameters and of the file order")
  strategy: str = _flag("dual_chunk_swap", "CP load balancing", choices=(
      "dual_chunk_swap", "no_load_balance"))
  backend: str = _flag("auto", "varlen attention backend",
                       choices=("auto", "xla", "cudnn"))
  max_seqlen: int | None = _flag(None, "static bound on padded document "
                                 "length (default: computed from the data)",
                                 int)
  max_doc_len: int | None = _flag(None, "cut files to this many bytes "
                                  "(default: seq-len / 2)", int)
  doc_order: str = _flag("balanced", "no_load_balance: each row's documents"
                         " reordered so that its contiguous chunks hold equal"
                         " attention work, or as packed (dual_chunk_swap: "
                         "always packed)", choices=("balanced", "packed"))
  checkpoint_dir: str | None = _flag(None, "save here (orbax) and resume "
                                     "from the last step", str)
  checkpoint_every: int = _flag(50, "steps between checkpoints")
  no_compare: bool = _flag(False, "skip the final comparison with a no-CP "
                           "evaluation")
  quiet: bool = _flag(False, "no progress bar or log")
  report: str | None = _flag(None, "write the result dict as JSON; '{process}'"
                             " is replaced by the process id (without it, "
                             "process 0 writes)", str)
  coordinator: str | None = _flag(None, "several processes: address "
                                  "HOST:PORT of process 0 (default: "
                                  "$JAX_CP_COORDINATOR)", str)
  num_processes: int | None = _flag(None, "several processes: how many "
                                    "(default: $JAX_CP_NUM_PROCESSES)", int)
  process_id: int | None = _flag(None, "several processes: this one's index"
                                 " (default: $JAX_CP_PROCESS_ID)", int)

  def __post_init__(self):
    if self.dtype is None:
      self.dtype = "bfloat16" if self.device == "gpu" else "float32"
    if self.max_doc_len is None:
      self.max_doc_len = max(self.seq_len // 2, 1)
    if self.lr is None:   # wider models take smaller steps
      self.lr = min(3e-3, 0.6 / self.d_model)
    if self.warmup is None:
      self.warmup = max(1, min(100, self.steps // 10))
    if self.strategy != "no_load_balance":
      self.doc_order = "packed"   # DUAL_CHUNK_SWAP's work ignores the order
    if self.remat not in REMAT:
      raise ValueError(f"remat={self.remat!r} is not one of {list(REMAT)}")


def build_parser() -> argparse.ArgumentParser:
  """The flags of :class:`Config`."""
  p = argparse.ArgumentParser(
      prog="python -m examples.packed_lm",
      description="Train a small byte-level decoder LM on packed documents "
      "with context parallelism.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  for f in dataclasses.fields(Config):
    name, meta = "--" + f.name.replace("_", "-"), f.metadata
    if isinstance(f.default, bool):
      p.add_argument(name, action="store_true", help=meta["help"])
    else:
      p.add_argument(name, type=meta["type"] or type(f.default),
                     default=f.default, choices=meta["choices"],
                     help=meta["help"])
  return p


def parse_args(argv: Sequence[str] | None = None) -> Config:
  return Config(**vars(build_parser().parse_args(argv)))


def num_processes(cfg: Config) -> int:
  """The process count of the flags or the environment (1 if unset)."""
  if cfg.num_processes is not None:
    return cfg.num_processes
  try:   # a malformed value is reported by multihost.init_distributed
    return int(os.environ.get("JAX_CP_NUM_PROCESSES", ""))
  except ValueError:
    return 1


def choose_mesh_shape(dp: int | None, cp: int | None, device: str,
                      num_devices: int | None,
                      batch: int | None = None) -> tuple[int, int]:
  """``(dp, cp)``: the values given, the rest chosen. On CPU ``2 x 4``; on
  GPU (``num_devices`` present) ``cp`` = all of them with ``dp`` = 1 (one
  long row per step gains most from context parallelism), or the other
  factor when one is given (a chosen ``dp`` also divides ``batch``)."""
  if device == "cpu" or num_devices is None:
    return (dp or CPU_DP, cp or CPU_CP)
  if dp is None and cp is None:
    return 1, num_devices
  if dp is None:
    dp = max(num_devices // cp, 1)
    return (math.gcd(dp, batch) if batch else dp), cp
  if cp is None:
    return dp, max(num_devices // dp, 1)
  return dp, cp


def configure_platform(cfg: Config) -> None:
  """Before jax is imported: on CPU, ``JAX_PLATFORMS=cpu`` and (one
  process, ``XLA_FLAGS`` not setting it) ``max(8, dp*cp)`` virtual
  devices; several processes get ``dp*cp/N`` each from ``main``."""
  if cfg.device == "gpu":
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if (num_processes(cfg) <= 1
      and "xla_force_host_platform_device_count" not in flags):
    dp, cp = choose_mesh_shape(cfg.dp, cfg.cp, "cpu", None)
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_"
                               f"count={max(8, dp * cp)}").strip()
