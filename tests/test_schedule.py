"""benchmarks.schedule reads what runs beside each collective of a
scheduled HLO module."""

from benchmarks import schedule

HLO = """\
HloModule step, is_scheduled=true

%mm (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  ROOT %d = bf16[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p: bf16[64,32], q: bf16[32,16], k: bf16[8,4]) -> bf16[64,16] {
  %p = bf16[64,32]{1,0} parameter(0)
  %q = bf16[32,16]{1,0} parameter(1)
  %k = bf16[8,4]{1,0} parameter(2)
  %ag = ((bf16[8,4]{1,0}), bf16[32,4]{1,0}) all-gather-start(%k), channel_id=1
  %f = bf16[64,16]{1,0} fusion(%p, %q), kind=kCustom, calls=%mm
  %ag.done = bf16[32,4]{1,0} all-gather-done(%ag)
  %cp = ((bf16[8,4]{1,0}), bf16[8,4]{1,0}) collective-permute-start(%k), channel_id=2
  %att = f32[8,4]{1,0} fusion(%k), kind=kLoop, calls=%x, metadata={op_name="jit(step)/shard_map/add"}
  %cp.done = bf16[8,4]{1,0} collective-permute-done(%cp)
  %rs.start = (f32[16,4]{1,0}, f32[4,4]{1,0}) reduce-scatter-start(%att), channel_id=3
  %rs.done = f32[4,4]{1,0} reduce-scatter-done(%rs.start)
  %sync = f32[8,4]{1,0} collective-permute(%att), channel_id=4
  ROOT %out = bf16[64,16]{1,0} copy(%f)
}
"""


def test_collectives_and_what_runs_beside_them():
  got = {c["name"]: c for c in schedule.collectives(HLO)}
  assert set(got) == {"ag", "cp", "rs.start", "sync"}
  ag, cp, rs, sync = got["ag"], got["cp"], got["rs.start"], got["sync"]
  assert (ag["kind"], ag["bytes"], ag["matmul_flops"]) == (
      "all-gather", 32 * 4 * 2, 2 * 64 * 16 * 32)
  assert (cp["kind"], cp["attention_ops"], cp["matmul_flops"]) == (
      "collective-permute", 1, 0)
  assert (rs["bytes"], rs["attention_ops"], rs["matmul_flops"]) == (
      4 * 4 * 4, 0, 0)
  assert sync["sync"] and sync["bytes"] == 8 * 4 * 4
  s = schedule.summarize(HLO)
  assert s["kinds"]["collective-permute"]["sync"] == 1
  assert s["kinds"]["collective-permute"]["beside_attention"] == 64
  assert s["unhidden_bytes"] == 4 * 4 * 4 + 8 * 4 * 4
