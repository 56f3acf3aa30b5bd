"""Tool use with a tiny from-scratch policy: arithmetic problems, a calculator tool, CPU.

The policy may write <calc>expr</calc> to get <result>value</result> back, then answers with
<answer>v</answer>; reward 1 for a correct answer.

Launch: python launch/train.py --config=configs/calculator_tiny.py
"""

import ml_collections

from configs import connect_four_tiny


def get_config() -> ml_collections.ConfigDict:
  c = connect_four_tiny.get_config()
  c.env.name = "calculator"
  c.env.calculator.kinds = ("arithmetic",)
  c.env.calculator.min_ops = 1
  c.env.calculator.max_ops = 2
  c.env.calculator.max_operand = 9
  c.sampler.restrict_answers = False  # free-text answers and tool calls
  c.sampler.legal_answers = False
  c.rollout.max_turns = 4
  c.rollout.max_new_tokens = 24  # room for <calc>...</calc> or <answer>...</answer>
  c.rollout.max_context = 256
  c.model.max_seq_len = 256
  c.train.eval_opponents = ()
  c.train.baselines = ()  # scripted baselines are game players
  return connect_four_tiny.plain_grpo(c)
