"""The deterministic mode: whether attention runs in a fixed order.

In the mode every kernel jax_cp runs and every sum it forms gives the
same bits from run to run on the same devices and program
(docs/determinism.md): the cuDNN backward runs the frontend's
deterministic algorithm, and the CP paths sum gradients in a fixed order
(:mod:`jax_cp.cp.exchange`). A user chooses it in one place, a
``deterministic`` argument (:class:`jax_cp.CPLayout`, the modules' layout,
:func:`jax_cp.fused_attention`): ``True`` or ``False``, or ``None`` (the
default) to follow XLA's own request for deterministic execution, the flag
``--xla_gpu_exclude_nondeterministic_ops`` or the older
``--xla_gpu_deterministic_ops``.

XLA reads its flags (``XLA_FLAGS``) once per process, when it first builds
compile options; JAX reads them back from there
(``xla_client.CompileOptions()``, as ``jax._src.compiler`` does for every
compilation). :func:`xla_requests_determinism` reads the same debug
options, once per process: never the environment, and never anew while a
program is traced. Options passed to one compilation
(``.compile(compiler_options=...)``) are not seen here; pass
``deterministic=True`` with them.
"""

from __future__ import annotations

import functools

#: The field numbers, in XLA's protos, of the path from
#: ``CompileOptionsProto`` to the flags: ``executable_build_options`` (3),
#: its ``debug_options`` (3), and the two ``DebugOptions`` booleans.
_BUILD_OPTIONS_FIELD = 3
_DEBUG_OPTIONS_FIELD = 3
#: ``xla_gpu_deterministic_ops``, ``xla_gpu_exclude_nondeterministic_ops``.
DETERMINISM_FLAG_FIELDS = {148: "xla_gpu_deterministic_ops",
                           297: "xla_gpu_exclude_nondeterministic_ops"}


def _varint(data: bytes, i: int) -> tuple[int, int]:
  """The varint at ``data[i:]`` and the index after it."""
  value, shift = 0, 0
  while True:
    if i >= len(data):
      raise ValueError("truncated varint in XLA's compile options")
    byte = data[i]
    i += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value, i
    shift += 7


def proto_fields(data: bytes) -> list[tuple[int, int | bytes]]:
  """The ``(field number, value)`` pairs of a serialized protobuf message
  in wire order: varints as ints, length-delimited fields as bytes,
  fixed-width ones as their raw bytes.

  Raises:
    ValueError: malformed data, or a group (wire types 3 and 4).
  """
  fields, i = [], 0
  while i < len(data):
    key, i = _varint(data, i)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _varint(data, i)
    elif wire == 2:
      size, i = _varint(data, i)
      value, i = data[i:i + size], i + size
    elif wire in (1, 5):
      size = 8 if wire == 1 else 4
      value, i = data[i:i + size], i + size
    else:
      raise ValueError(f"unsupported protobuf wire type {wire} (field "
                       f"{number}) in XLA's compile options")
    if i > len(data):
      raise ValueError("truncated field in XLA's compile options")
    fields.append((number, value))
  return fields


def _message(data: bytes, number: int) -> bytes:
  """The last length-delimited field ``number`` of ``data`` (empty when
  absent: every field at its default)."""
  found = b""
  for n, value in proto_fields(data):
    if n == number and isinstance(value, bytes):
      found = value
  return found


def determinism_flags(compile_options: bytes) -> dict[str, bool]:
  """The two determinism flags of XLA's debug options in a serialized
  ``CompileOptionsProto``, by name (False where absent)."""
  debug = _message(_message(compile_options, _BUILD_OPTIONS_FIELD),
                   _DEBUG_OPTIONS_FIELD)
  flags = dict.fromkeys(DETERMINISM_FLAG_FIELDS.values(), False)
  for number, value in proto_fields(debug):
    if number in DETERMINISM_FLAG_FIELDS and isinstance(value, int):
      flags[DETERMINISM_FLAG_FIELDS[number]] = bool(value)
  return flags


@functools.cache
def xla_requests_determinism() -> bool:
  """Whether XLA was asked for deterministic execution in this process
  (``--xla_gpu_exclude_nondeterministic_ops`` or
  ``--xla_gpu_deterministic_ops``), as JAX's compile options hold it.

  XLA parses its flags once per process, so the answer cannot change and
  is read once (the module docstring)."""
  from jaxlib import xla_client  # pylint: disable=import-outside-toplevel
  options = xla_client.CompileOptions().SerializeAsString()
  return any(determinism_flags(options).values())


def check_deterministic(value, name: str = "deterministic") -> None:
  """``value`` must be None, True or False.

  Raises:
    ValueError: naming ``name`` and the value.
  """
  if value is not None and not isinstance(value, bool):
    raise ValueError(f"{name} must be None (follow XLA's "
                     f"--xla_gpu_exclude_nondeterministic_ops), True or "
                     f"False; got {value!r}")


def resolve_deterministic(value: bool | None) -> bool:
  """The mode a choice means: ``value`` itself, or for None whether XLA
  was asked for deterministic execution (:func:`xla_requests_determinism`).

  Raises:
    ValueError: ``value`` is not None, True or False.
  """
  check_deterministic(value)
  return xla_requests_determinism() if value is None else value
