"""Which native classes shard themselves across tensor-parallel ranks; the others are a clear error
under TP rather than a TypeError or an unsharded copy per rank."""

from __future__ import annotations

from tokenmill.models.deepseek_v3 import DeepseekV3ForCausalLM
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.gpt_oss import GptOssForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.mixtral import MixtralForCausalLM
from tokenmill.models.nemotron_h import NemotronHForCausalLM
from tokenmill.models.qwen3_next import Qwen3NextForCausalLM
from tokenmill.models.qwen_moe import QwenMoeForCausalLM
from tokenmill.models.registry import takes_tensor_parallel


def test_the_sharded_families_take_tp_and_the_others_do_not() -> None:
    for sharded in (
        LlamaForCausalLM,
        Gemma3ForCausalLM,
        MixtralForCausalLM,
        QwenMoeForCausalLM,
        DeepseekV3ForCausalLM,
    ):
        assert takes_tensor_parallel(sharded), sharded.__name__
    for whole in (GptOssForCausalLM, Qwen3NextForCausalLM, NemotronHForCausalLM):
        assert not takes_tensor_parallel(whole), whole.__name__
