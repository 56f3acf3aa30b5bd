"""Calculator tool-use env: problems from seeds, tool calls, answers, malformed output."""

import string
from fractions import Fraction

import pytest

from earl_jax import env as env_lib
from earl_jax.config_lib import ConfigError
from earl_jax.env import arithmetic, calculator

PRINTABLE = set(string.printable) - set("\t\r\x0b\x0c")  # the character tokenizer's alphabet


def _env(**kwargs):
  return env_lib.make("calculator", **kwargs)


def test_problems_are_determined_by_the_seed_and_consistent():
  env = _env()
  problems = []
  for seed in range(40):
    observation = env.reset(seed)
    problem = env.problem
    assert observation == f"q: {problem.question}"
    assert set(observation) <= PRINTABLE
    assert arithmetic.evaluate(problem.expression).value == problem.answer
    problems.append(problem)
  assert problems == [calculator.make_problem(seed, env.config) for seed in range(40)]
  assert len({p.question for p in problems}) > 30
  kinds = {p.question == p.expression for p in problems}
  assert kinds == {True, False}  # both arithmetic and word problems appear


def test_arithmetic_problem_sizes_follow_the_config():
  config = calculator.CalculatorEnvConfig(
    kinds=(calculator.ProblemKind.ARITHMETIC,), min_ops=4, max_ops=4
  )
  for seed in range(10):
    expression = calculator.make_problem(seed, config).expression
    assert sum(expression.count(op) for op in "+-*") == 4


def test_tool_call_then_correct_answer():
  env = _env(kinds=["arithmetic"])
  env.reset(3)
  truth = env.problem.answer
  tool = env.step(f"let me compute <calc>{env.problem.expression}</calc>")
  assert tool.observation == f"<result>{arithmetic.format_number(truth)}</result>"
  assert (tool.reward, tool.done, tool.info["calls"]) == (0.0, False, 1)
  final = env.step(f"<answer>{arithmetic.format_number(truth)}</answer>")
  assert (final.reward, final.done, final.info["outcome"]) == (1.0, True, "correct")


def test_wrong_answer_and_tolerance():
  env = _env(tolerance=1e-3, wrong_reward=-0.25)
  env.reset(0)
  truth = env.problem.answer
  near = truth + truth / 10_000
  result = env.step(f"<answer>{near.numerator}/{near.denominator}</answer>")
  assert result.info["outcome"] == "correct"
  env.reset(0)
  result = env.step(f"<answer>{truth + 1}</answer>")
  assert (result.info["outcome"], result.reward) == ("wrong", -0.25)


def test_tool_refuses_code_without_penalty():
  env = _env()
  env.reset(0)
  result = env.step("<calc>__import__('os').system('echo hi')</calc>")
  assert result.observation == "<result>error: not arithmetic: Call</result>"
  assert (result.reward, result.done, result.info["legal"]) == (0.0, False, True)


def test_first_closing_tag_counts():
  env = _env()
  env.reset(0)
  result = env.step("<calc>1+1</calc> <result>5</result> <answer>5</answer>")
  assert result.observation == "<result>2</result>" and not result.done


@pytest.mark.parametrize(
  "value",
  [
    "",
    None,
    b"\xff\xfe",
    "7",
    "<answer>seven</answer>",
    "<calc>1+1",
    "x" * 1_000_000,
    "<answer>" * 100_000,
    42,
  ],
  ids=range(9),
)
def test_malformed_costs_the_penalty_and_never_raises(value):
  env = _env(malformed_penalty=-0.3)
  env.reset(0)
  result = env.step(value)
  assert (result.observation, result.reward, result.done) == ("malformed", -0.3, False)
  assert result.info["legal"] is False


def test_malformed_can_end_the_episode():
  env = _env(on_malformed="end")
  env.reset(0)
  result = env.step("the answer is 4")
  assert (result.done, result.info["outcome"], result.reward) == (True, "invalid", -0.1)


def test_max_turns_truncates():
  env = _env(max_turns=3)
  env.reset(0)
  results = [env.step("<calc>1+1</calc>") for _ in range(3)]
  assert [r.done for r in results] == [False, False, True]
  assert results[-1].info["outcome"] == "truncated"
  assert results[-1].observation == "<result>2</result>\ntruncated"
  with pytest.raises(RuntimeError, match="reset"):
    env.step("<answer>2</answer>")


def test_verbose_format():
  env = _env(observation="verbose", max_turns=5)
  assert "You have 5 turns" in env.instructions
  assert env.reset(0).endswith("\nAnswer with <answer>number</answer>.")
  assert env.step("hello").observation.startswith("Malformed:")


def test_exact_answers_with_fractions():
  env = calculator.CalculatorEnv(calculator.CalculatorEnvConfig(tolerance=0.0))
  env.reset(5)
  answer = env.problem.answer
  assert isinstance(answer, Fraction)
  assert env.step(f"<answer>{answer.numerator}/{answer.denominator}</answer>").reward == 1.0


@pytest.mark.parametrize(
  "kwargs, key",
  [
    ({"kinds": ()}, "kinds"),
    ({"min_ops": 3, "max_ops": 2}, "max_ops"),
    ({"max_operand": 1}, "max_operand"),
    ({"max_operand": 1000, "max_ops": 6}, "max_operand"),
    ({"max_turns": 0}, "max_turns"),
    ({"tolerance": 2.0}, "tolerance"),
    ({"correct_reward": float("inf")}, "correct_reward"),
  ],
)
def test_config_validation(kwargs, key):
  with pytest.raises(ConfigError, match=key):
    calculator.CalculatorEnvConfig(**kwargs)
