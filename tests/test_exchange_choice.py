"""The exchange planner (jax_cp.planning.recommend_exchange): each
exchange's predicted time is the cost model's formula written out here
from its parts; the all-to-all moves (Hq + Hkv)/(cp·Hkv) of the
all-gather's bytes; exchanges a layout would reject are ruled out with
the reason; the choice follows the bandwidth."""

import numpy as np
import pytest

from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.planning import estimate_cp_imbalance, recommend_exchange
from jax_cp.planning.cost_model import FWD_BWD_FLOP_FACTOR
from jax_cp.planning.exchange_choice import head_scatter_bytes

ONE_DOC = np.array([[0, 65536]])
SHORT = np.array([np.arange(0, 65537, 1024)])
HEADS = dict(num_heads_q=32, num_heads_kv=8, head_dim=128)


def test_all_to_all_moves_its_share_of_the_all_gathers_bytes():
  est = estimate_cp_imbalance(ONE_DOC, ONE_DOC, CPLayout(cp_size=8),
                              **HEADS)
  moved = head_scatter_bytes(1, 65536 // 8, 32, 8, 128, 2, 8,
                             include_backward=False)
  assert moved / est.allgather_bytes == pytest.approx((32 + 8) / (8 * 8))
  # Fewer K/V heads than ranks: each is sent to cp / Hkv ranks.
  assert head_scatter_bytes(1, 64, 8, 1, 8, 2, 4, False) == \
      pytest.approx(64 * (2 * 8 + 2 * 4) * 8 * 2 * 3 / 4)


@pytest.mark.parametrize("cu", [ONE_DOC, SHORT], ids=["one_doc", "short"])
def test_all_to_all_time_is_the_model_written_out(cu):
  peak, bw, call = 500e12, 100e9, 20e-6
  rec = recommend_exchange(cu, cu, 8, **HEADS, peak_flops=peak,
                           bandwidth=bw, call_overhead_s=call)
  est = estimate_cp_imbalance(cu, cu, CPLayout(cp_size=8), **HEADS)
  docs = cu.shape[-1] - 1
  # cp = 1 on whole rows: one call over every document, both ways.
  calls = 2
  moved = 2 * (65536 // 8) * (2 * 32 + 2 * 8) * 128 * 2 * 7 / 8
  want = (est.total_flops / 8 * FWD_BWD_FLOP_FACTOR / peak + moved / bw
          + calls * call)
  assert rec.predicted_time_s["all_to_all"] == pytest.approx(want)
  assert rec.predicted_time_s["all_gather"] == pytest.approx(
      est.predicted_time_s(peak_flops=peak, bandwidth=bw,
                           call_overhead_s=call, include_backward=True))
  assert rec.predicted_time_s["ring"] == pytest.approx(
      est.predicted_time_s(peak_flops=peak, bandwidth=bw,
                           call_overhead_s=call, include_backward=True,
                           comm_type="ring"))
  assert rec.comm_type == min(rec.predicted_time_s,
                              key=rec.predicted_time_s.get)
  assert docs >= 1 and rec.comm_type in rec.reason


def test_a_slow_link_picks_the_all_to_all():
  """The exchange exposed (a slow link): the fewest bytes win."""
  rec = recommend_exchange(SHORT, SHORT, 8, **HEADS, bandwidth=1e9)
  assert rec.comm_type == "all_to_all", rec.reason
  assert rec.predicted_time_s["all_to_all"] < rec.predicted_time_s[
      "all_gather"]


def test_rejected_exchanges_are_ruled_out_with_the_reason():
  rec = recommend_exchange(ONE_DOC, ONE_DOC, 4, num_heads_q=6,
                           num_heads_kv=2, window_size=(128, 0))
  assert "ring" in rec.ruled_out and "window" in rec.ruled_out["ring"]
  assert "all_to_all" in rec.ruled_out
  assert "6 heads" in rec.ruled_out["all_to_all"]
  assert set(rec.predicted_time_s) == {"all_gather"}
  nlb = recommend_exchange(ONE_DOC, ONE_DOC, 4, strategy=S.NO_LOAD_BALANCE,
                           **HEADS, window_size=(128, 0))
  assert "ring" in nlb.predicted_time_s    # the halo moves the window's keys


def test_hierarchical_is_its_ring_plus_the_inner_all_to_all():
  peak, bw, inner = 500e12, 25e9, 400e9
  rec = recommend_exchange(SHORT, SHORT, 8, **HEADS, cp_inner=4,
                           peak_flops=peak, bandwidth=bw,
                           inner_bandwidth=inner)
  ring = estimate_cp_imbalance(SHORT, SHORT, CPLayout(cp_size=2),
                               num_heads_q=8, num_heads_kv=2, head_dim=128)
  moved = head_scatter_bytes(1, 65536 // 8, 32, 8, 128, 2, 4, True)
  want = ring.predicted_time_s(peak_flops=peak, bandwidth=bw,
                               include_backward=True,
                               comm_type="ring") + moved / inner
  assert rec.predicted_time_s["all_to_all+ring"] == pytest.approx(want)
  with pytest.raises(ValueError, match="cp_inner=3 must divide"):
    recommend_exchange(SHORT, SHORT, 8, **HEADS, cp_inner=3)
  with pytest.raises(ValueError, match="bandwidth"):
    recommend_exchange(SHORT, SHORT, 8, **HEADS, bandwidth=0.0)
