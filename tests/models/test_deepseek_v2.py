"""DeepSeek-V2 (`model_type: deepseek_v2`) against transformers' `DeepseekV2ForCausalLM`.

Tiny random models written by transformers' `save_pretrained`, config as written: V2-Lite's
shape (`helpers.TINY_DEEPSEEK_V2`: a plain query projection, yarn rope, one dense first layer,
the softmax router choosing by score, two shared experts, routed_scaling_factor 1.5), and V2's
(a low-rank query, `group_limited_greedy` over two expert groups of which each token uses one).
Their logits, loss and every gradient equal transformers'; the round trip is bit for bit.
"""

import json

import numpy as np
import pytest

from jaxpipe.models import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 384, 4, 24  # SEQ beyond yarn's original context (16)
GROUPED = dict(q_lora_rank=12, topk_method="group_limited_greedy", n_group=2, topk_group=1)


@pytest.fixture(scope="module", params=["lite", "grouped"])
def checkpoint(request, tmp_path_factory):
  """(transformers' checkpoint directory, its model, the shape's name)."""
  fields = GROUPED if request.param == "grouped" else {}
  src = helpers.write_tiny_model(
      tmp_path_factory.mktemp("deepseek_v2") / "src", "deepseek_v2", seed=3, **fields
  )
  return src, helpers.load_hf_model(src), request.param


def test_the_config_reads_as_deepseek_v2s_router(checkpoint):
  src, _, shape = checkpoint
  cfg = hf.check(src).cfg
  m = cfg.moe
  assert (m.router, m.norm_topk_prob, m.routed_scaling, m.num_shared_experts) == (
      "softmax",
      False,
      1.5,
      2,
  )
  assert cfg.mla.rope_interleave and cfg.first_dense == 1
  if shape == "grouped":
    assert (m.n_groups, m.topk_groups, cfg.mla.q_lora_rank) == (2, 1, 12)
  else:
    assert (m.n_groups, cfg.mla.q_lora_rank) == (1, None)


def test_logits_loss_and_gradients_equal_transformers(checkpoint, tmp_path):
  src, model, _ = checkpoint
  cfg, params = hf.load(src)
  ids = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ))
  helpers.check_against_transformers(cfg, params, model, ids, tmp_path, "deepseek_v2")


def test_export_and_import_round_trip_bit_for_bit(checkpoint, tmp_path):
  cfg = helpers.check_round_trip(checkpoint[0], str(tmp_path / "out"))
  # no source config: DeepSeek-V3's family refuses the softmax router, V2's computes it
  fresh = hf.config_to_hf(cfg)
  assert fresh["model_type"] == "deepseek_v2"
  assert fresh["topk_method"] == ("greedy" if cfg.moe.n_groups == 1 else "group_limited_greedy")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(topk_method="noaux_tc"), r"topk_method='noaux_tc'.*one of \('greedy'"),
        (dict(mlp_bias=True), r"mlp_bias=True.*the FFNs have no biases"),
        (dict(attention_bias=True), r"attention_bias=True.*the latent attention has no biases"),
        (dict(num_experts_per_tok=None), r"'num_experts_per_tok' is missing.*'deepseek_v2'"),
    ],
)
def test_what_deepseek_v2_cannot_read_is_one_line(changes, match):
  fields = {**helpers.TINY_DEEPSEEK_V2, "num_key_value_heads": 4}
  hf_config = json.loads(json.dumps(transformers.DeepseekV2Config(**fields).to_dict()))
  hf_config.update(changes, architectures=["DeepseekV2ForCausalLM"])
  with pytest.raises(hf.CheckpointError, match=match):
    hf.config_from_hf(hf_config)
