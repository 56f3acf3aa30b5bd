"""The paper's setting: Connect Four with Qwen2.5-72B-Instruct on 128 GPUs (16 hosts x 8).

Launch (SLURM, one process per host):
  sbatch --nodes=16 launch/gpu_slurm.sbatch configs/connect_four_qwen2_5_72b.py /ckpt/c4_qwen72b
TPU pod (on every worker):
  bash launch/tpu_pod.sh configs/connect_four_qwen2_5_72b.py gs://bucket/c4_qwen72b
Context grows during training; the selector re-picks the rollout tensor size (4 or 8 in the
paper) per context bucket, and the reference/update layouts too.
"""

import ml_collections

from configs import connect_four_qwen2_5_0_5b


def get_config() -> ml_collections.ConfigDict:
  c = connect_four_qwen2_5_0_5b.get_config()
  c.pretrained_path = "Qwen/Qwen2.5-72B-Instruct"
  c.model.max_seq_len = 32768
  c.rollout.max_context = 32768
  c.rollout.num_slots = 128  # the paper's largest #responses
  c.rl.num_groups = 16
  c.rl.group_size = 8
  c.parallel.selector = True
  c.parallel.rollout_layout.tensor = 4  # the paper starts rollout at TP=4
  c.parallel.reference_layout.tensor = 8
  c.parallel.update_layout.fsdp = 16
  c.parallel.update_layout.tensor = 8
  c.parallel.update_layout.micro_batch_size = 16
  return c
