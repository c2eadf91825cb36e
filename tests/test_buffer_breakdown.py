"""benchmarks/buffer_breakdown.py on CPU: the parser on a real XLA dump of
a tiny function with a temporary of known size, on small hand-written
dumps, and bench_memory's ``--breakdown``."""

from __future__ import annotations

import glob
import json
import os

from benchmarks import bench_memory
from benchmarks import buffer_breakdown as bb


def _lowered():
  """A gradient whose forward keeps ``tanh(x @ w)``: f32[512,1024], 2 MiB,
  a temporary of the compiled step."""
  import jax
  import jax.numpy as jnp

  def f(x, w):
    return jnp.sum(jnp.tanh(x @ w) @ w.T)

  x, w = jnp.ones((512, 256)), jnp.ones((256, 1024))
  return jax.jit(jax.grad(f, argnums=1)).lower(x, w)


HIDDEN = 512 * 1024 * 4


def test_parser_finds_the_known_temporary(tmp_path):
  """The per-compile dump (jax's compiler_options) writes the buffer
  assignment; the parser finds the temp allocation of memory analysis's
  size, a value of the hidden's exact bytes in it, the arguments as
  parameters, and the peak's live set."""
  compiled = _lowered().compile(
      compiler_options=bb.dump_options(str(tmp_path)))
  paths = glob.glob(str(tmp_path / "*after_optimizations-buffer-"
                                    "assignment.txt"))
  assert len(paths) == 1
  with open(paths[0]) as f:
    parsed = bb.parse_buffer_assignment(f.read())
  kinds = {}
  for a in parsed["allocations"]:
    kinds[a["kind"]] = kinds.get(a["kind"], 0) + a["size"]
  ma = compiled.memory_analysis()
  assert kinds["temp"] == ma.temp_size_in_bytes
  assert kinds["parameter"] == ma.argument_size_in_bytes
  temp_values = [v for a in parsed["allocations"] if a["kind"] == "temp"
                 for v in a["values"]]
  assert any(v["size"] == HIDDEN and v["shape"] == "f32[512,1024]"
             for v in temp_values)

  got = bb.from_dump(str(tmp_path))
  assert got["allocations"]["temp"]["bytes"] == ma.temp_size_in_bytes
  assert got["top_temp"][0]["bytes"] == HIDDEN
  assert got["peak"]["bytes"] >= HIDDEN
  assert got["peak"]["by_category"]["state"] == ma.argument_size_in_bytes
  json.dumps(got)   # JSON-serializable


def test_compile_with_breakdown_cleans_up(tmp_path, monkeypatch):
  """The compile and its breakdown; the dump's folder removed after."""
  monkeypatch.setattr(bb.tempfile, "tempdir", str(tmp_path))
  compiled, got = bb.compile_with_breakdown(_lowered())
  assert compiled.memory_analysis().temp_size_in_bytes > 0
  assert max(v["bytes"] for v in got["top_temp"]) == HIDDEN
  assert os.listdir(tmp_path) == []


BUFFER_ASSIGNMENT = """\
BufferAssignment:
allocation 0: size 64, page 0, parameter 0, shape |f32[16]| at ShapeIndex {}, maybe-live-out:
 value: <1 p.1 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 8, page 0, output shape is |(f32[], f32[])|, maybe-live-out:
 value: <9 tuple.3{} @0> (size=8,offset=0): (f32[], f32[])
allocation 2: size 4, page 0, constant:
 value: <2 constant.1 @0> (size=4,offset=0): f32[]
allocation 3: size 1, page 0, thread-local:
 value: <3 add.2 @0> (size=1,offset=0): pred[]
allocation 4: size 4096, page 0, preallocated-temp:
 value: <4 custom-call.7{0} @0> (size=2048,offset=0): bf16[1024]{0}
 value: <5 custom-call.7{1} @0> (size=1024,offset=2048): u8[1024]{0}
 value: <6 fusion.4 @0> (size=4096,offset=0): f32[1024]{0}

BufferAssignment stats:
             parameter allocation:       64B
"""  # noqa: E501

LIVE_RANGE = """\
HloLiveRange (max 3):
  InstructionSequence:
    0:p.1
  BufferLiveRange:
    p.1{}:0-3
  Live ranges at 2 (peak):
    fusion.4{}: 4096 bytes (cumulative: 4096 bytes)
    custom-call.7{1}: 1024 bytes (cumulative: 5120 bytes)
    p.1{}: 64 bytes (cumulative: 5184 bytes)
  Stack trace breakdown for peak usage: 5 184 bytes
"""

HLO = """\
HloModule m

FileNames
1 "/x/jax_cp/modules/common.py"
2 "/x/examples/packed_lm/lm_loss.py"

FunctionNames
1 "mlp_hidden"
2 "token_losses"

FileLocations
1 {file_name_id=1 function_name_id=1 line=9 end_line=9 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=40 end_line=40 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

%fused (a: f32[16]) -> f32[1024] {
  %a = f32[16]{0} parameter(0)
  ROOT %b = f32[1024]{0} broadcast(%a), metadata={op_name="jit(step)/transpose(jvp())/mul" stack_frame_id=2}
}

ENTRY %main (p.1: f32[16]) -> (f32[], f32[]) {
  %p.1 = f32[16]{0} parameter(0), metadata={op_name="p"}
  %fusion.4 = f32[1024]{0} fusion(%p.1), kind=kLoop, calls=%fused
  %custom-call.7 = (bf16[1024]{0}, u8[1024]{0}) custom-call(%p.1), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(step)/jvp()/custom_call"}
}
"""  # noqa: E501


def test_parser_on_a_written_dump():
  """Allocation kinds, tuple indices, the peak's live set, and categories
  from the call stack (a fusion takes its root's), the custom call's
  target and the parameters (state)."""
  parsed = bb.parse_buffer_assignment(BUFFER_ASSIGNMENT)
  assert [a["kind"] for a in parsed["allocations"]] == [
      "parameter", "output", "constant", "thread-local", "temp"]
  temp = parsed["allocations"][-1]["values"]
  assert [(v["name"], v["index"], v["size"], v["shape"]) for v in temp] == [
      ("custom-call.7", "{0}", 2048, "bf16[1024]"),
      ("custom-call.7", "{1}", 1024, "u8[1024]"),
      ("fusion.4", "{}", 4096, "f32[1024]")]
  peak = bb.parse_live_range_peak(LIVE_RANGE)
  assert peak["step"] == 2 and [b["bytes"] for b in peak["buffers"]] == [
      4096, 1024, 64]
  meta = bb.parse_hlo_metadata(HLO)
  assert meta["fusion.4"]["functions"] == ["mlp_hidden", "token_losses"]
  assert bb.categorize(meta["fusion.4"]) == "mlp"      # innermost wins
  assert bb.phase(meta["fusion.4"]) == "bwd"
  assert bb.categorize(meta["custom-call.7"]) == "attention"
  got = bb.summarize(parsed, peak, meta, top=2)
  assert got["allocations"]["temp"] == dict(bytes=4096, count=1)
  assert [e["name"] for e in got["top_temp"]] == ["fusion.4",
                                                  "custom-call.7{0}"]
  assert got["peak"]["bytes"] == 5184
  assert got["peak"]["by_category"] == {"mlp": 4096, "attention": 1024,
                                        "state": 64}
  assert got["peak"]["top"][1]["shape"] == "u8[1024]"


def test_bench_memory_breakdown_compile_only(tmp_path):
  """--compile-only --breakdown: the record's breakdown, its largest temp
  value within XLA's temp bytes, the arguments as state and attention
  among the peak's categories; the table row says compiled."""
  path = bench_memory.main([
      "--device", "cpu", "--backend", "xla", "--layers", "1", "--d-model",
      "64", "--heads", "2", "--kv-heads", "1", "--max-doc-len", "128",
      "--seq-lens", "512", "--compile-only", "--breakdown",
      "--out", str(tmp_path)])
  with open(path) as f:
    rec, = json.load(f)["records"]
  assert rec["status"] == "compiled"
  bd = rec["breakdown"]
  assert "error" not in bd
  assert 0 < bd["top_temp"][0]["bytes"] <= rec["temp_bytes"]
  assert bd["allocations"]["temp"]["bytes"] == rec["temp_bytes"]
  assert bd["peak"]["top"] and bd["peak"]["by_category"]["state"] > 0
  assert "attention" in bd["peak"]["by_category"]
  assert "| compiled |" in (tmp_path / "memory.md").read_text()
