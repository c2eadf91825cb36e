"""The run's settings: one dataclass, its command-line flags, and the
platform set-up that must happen before jax starts (no jax import here)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

CPU_DP, CPU_CP = 2, 4   # the CPU default mesh (8 virtual devices)
REMAT = ("none", "save_context", "minimal", "minimal_with_context", "full")


def _flag(default, help_: str, choices=None):
  if default is not None:   # those of None are said in help_
    help_ += " (default: %(default)s)"
  return dataclasses.field(default=default,
                           metadata=dict(help=help_, choices=choices))


@dataclasses.dataclass
class Config:
  """Every setting of a run; field ``x_y`` is the flag ``--x-y``. Defaults
  of ``None`` follow other fields, or (``dp``, ``cp``) the devices."""

  device: str = _flag("cpu", "platform", ("cpu", "gpu"))
  dtype: str | None = _flag(None, "computation dtype (default: bfloat16 on "
                            "GPU, float32 on CPU)", ("float32", "bfloat16"))
  layers: int = _flag(2, "transformer layers")
  d_model: int = _flag(128, "model width")
  heads: int = _flag(4, "query heads")
  kv_heads: int = _flag(2, "key/value heads")
  seq_len: int = _flag(512, "tokens per row")
  batch: int = _flag(2, "rows per step")
  dp: int | None = _flag(None, "data-parallel size (default: CPU 2, GPU 1)")
  cp: int | None = _flag(None, "context-parallel size (default: CPU 4, "
                         "GPU the other devices)")
  steps: int = _flag(100, "training steps")
  lr: float | None = _flag(None, "peak learning rate (default: min(3e-3, "
                           "0.6/d_model))")
  warmup: int | None = _flag(None, "warmup steps (default: 10%% of steps, at "
                             "most 100)")
  param_sharding: str = _flag("fsdp", "parameters and optimizer state",
                              ("fsdp", "replicated"))
  remat: str = _flag("none", "rematerialisation of the layers", REMAT)
  mlp_chunk_size: str = _flag("auto", "tokens per MLP chunk of each rank "
                              "(TransformerLayer.mlp_chunk_size): auto, "
                              "none (whole rows) or a positive int")
  layer_chunk_size: str = _flag("none", "tokens per chunk of the whole "
                                "layer, one rank only "
                                "(TransformerLayer.layer_chunk_size): none "
                                "(whole rows) or a positive int")
  prefetch: int = _flag(2, "batches built ahead (grain's thread "
                        "prefetch)")
  log_every: int = _flag(10, "steps between waits for the device (loss)")
  peak_tflops: float | None = _flag(None, "device peak for the MFU (default: "
                                    "known GPUs' bf16 peak)")
  seed: int = _flag(0, "seed of the parameters and the file order")
  strategy: str = _flag("dual_chunk_swap", "CP load balancing",
                        ("dual_chunk_swap", "no_load_balance"))
  backend: str = _flag("auto", "attention backend", ("auto", "xla", "cudnn"))
  scan_layers: bool = _flag(False, "run the layers as a scan over "
                            "stacked parameters (XLA schedules one layer)")
  comm_type: str = _flag("all_gather", "how K/V travel between CP ranks "
                         "(CPLayout.comm_type)", ("all_gather", "ring",
                                                 "all_to_all",
                                                 "all_to_all+ring"))
  cp_inner: int | None = _flag(None, "all_to_all+ring: ranks of the inner "
                               "cp axis, the all-to-all's (cp = outer x "
                               "inner; default: none, one cp axis)")
  max_seqlen: int | None = _flag(None, "bound on padded document "
                                 "lengths (default: the data's)")
  max_doc_len: int | None = _flag(None, "cut files to this many bytes "
                                  "(default: seq-len / 2); files under "
                                  "seq-len / 64 bytes are skipped")
  doc_order: str = _flag("balanced", "no_load_balance: documents reordered "
                         "for the ranks, or as packed", ("balanced", "packed"))
  checkpoint_dir: str | None = _flag(None, "save here and resume from it "
                                     "(default: no checkpoints)")
  checkpoint_every: int = _flag(50, "steps between checkpoints")
  no_compare: bool = _flag(False, "skip the final CP-vs-no-CP check")
  quiet: bool = _flag(False, "no progress bar or log")
  report: str | None = _flag(None, "write the result as JSON "
                             "('{process}': every process's)")
  coordinator: str | None = _flag(None, "several processes: HOST:PORT of "
                                  "process 0 (default: $JAX_CP_COORDINATOR)")
  num_processes: int | None = _flag(None, "several processes: how many "
                                    "(default: $JAX_CP_NUM_PROCESSES)")
  process_id: int | None = _flag(None, "several processes: this one's "
                                 "index (default: $JAX_CP_PROCESS_ID)")

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
    if (self.comm_type == "all_to_all+ring") != (self.cp_inner is not None):
      raise ValueError("comm_type='all_to_all+ring' and cp_inner go "
                       f"together, got {self.comm_type!r} and "
                       f"cp_inner={self.cp_inner}")
    if self.remat not in REMAT:
      raise ValueError(f"remat={self.remat!r} is not one of {list(REMAT)}")
    self.mlp_chunk_size = parse_chunk_size(self.mlp_chunk_size)
    self.layer_chunk_size = parse_chunk_size(self.layer_chunk_size,
                                             "layer_chunk_size", auto=False)


def parse_chunk_size(value, name: str = "mlp_chunk_size",
                     auto: bool = True):
  """``"auto"`` (with ``auto``), None (``"none"``) or a positive int, from
  a flag's text or a value given as it is; ``name`` names the flag in the
  error."""
  if value is None or (auto and value == "auto") or (
      isinstance(value, int) and not isinstance(value, bool) and value > 0):
    return value
  text = str(value).strip().lower()
  if text == "none":
    return None
  if text.isdigit() and int(text) > 0:
    return int(text)
  allowed = "auto, none" if auto else "none"
  raise ValueError(f"{name} must be {allowed} or a positive int, "
                   f"got {value!r}")


def build_parser() -> argparse.ArgumentParser:
  """The flags of :class:`Config`, with their defaults in the help."""
  p = argparse.ArgumentParser(
      prog="python -m examples.packed_lm", description="Train a small "
      "byte-level decoder LM on packed documents with context parallelism.")
  types = {"int": int, "float": float, "str": str}
  for f in dataclasses.fields(Config):
    name, meta = "--" + f.name.replace("_", "-"), f.metadata
    if f.type == "bool":
      p.add_argument(name, action="store_true", help=meta["help"])
    else:
      p.add_argument(name, type=types[f.type.split()[0]], default=f.default,
                     choices=meta["choices"], help=meta["help"])
  return p


def parse_args(argv: list[str] | None = None) -> Config:
  return Config(**vars(build_parser().parse_args(argv)))


def num_processes(cfg: Config) -> int:
  """The process count of the flags or the environment (1 if unset)."""
  env = os.environ.get("JAX_CP_NUM_PROCESSES", "")
  return cfg.num_processes or (int(env) if env.isdigit() else 1)


def choose_mesh_shape(dp: int | None, cp: int | None, device: str,
                      num_devices: int | None,
                      batch: int | None = None) -> tuple[int, int]:
  """``(dp, cp)``: those given, the others chosen: CPU ``2 x 4``; GPU ``1 x``
  every device, or the other factor (a chosen ``dp`` divides ``batch``)."""
  if device == "cpu" or num_devices is None:
    return dp or CPU_DP, cp or CPU_CP
  if cp is None:
    return dp or 1, max(num_devices // (dp or 1), 1)
  return dp or math.gcd(max(num_devices // cp, 1), batch or 0), cp


def configure_platform(cfg: Config) -> None:
  """On CPU, before jax is imported: ``JAX_PLATFORMS=cpu`` and (one process,
  ``XLA_FLAGS`` not setting it) ``max(8, dp*cp)`` virtual devices."""
  if cfg.device == "gpu":
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if (num_processes(cfg) <= 1
      and "xla_force_host_platform_device_count" not in flags):
    dp, cp = choose_mesh_shape(cfg.dp, cfg.cp, "cpu", None)
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_"
                               f"count={max(8, dp * cp)}").strip()
