"""Connect Four with Qwen2.5-7B-Instruct on one host of 8 GPUs (or a v5p-8 TPU slice).

Launch:
  python launch/train.py --config=configs/connect_four_qwen2_5_7b.py --workdir=/ckpt/c4_qwen7b
Selector: --config.parallel.selector=True chooses the layouts per context bucket.
"""

import ml_collections

from configs import connect_four_qwen2_5_0_5b


def get_config() -> ml_collections.ConfigDict:
  c = connect_four_qwen2_5_0_5b.get_config()
  c.pretrained_path = "Qwen/Qwen2.5-7B-Instruct"
  c.model.max_seq_len = 16384
  c.rollout.max_context = 16384
  c.parallel.rollout_layout.tensor = 4  # 28 heads, 4 kv heads: tensor in {1, 2, 4}
  c.parallel.reference_layout.tensor = 4
  c.parallel.update_layout.fsdp = 2
  c.parallel.update_layout.tensor = 4
  c.parallel.update_layout.micro_batch_size = 8
  return c
