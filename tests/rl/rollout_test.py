"""The multi-turn rollout with a tiny model against real environments.

Token-in/token-out is checked by recording what the sampler produced: exactly those ids, and only
those, carry the loss mask in the packed batch; the env text is the format's one-time encoding.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from earl_jax import env as env_lib
from earl_jax import model as model_lib
from earl_jax.model.config import ModelConfig
from earl_jax.rl import reference, rollout, turn_format
from earl_jax.sampler import engine, sampling, slots
from earl_jax.types import ConfigError

TOK = model_lib.CharTokenizer()
CFG = ModelConfig(
  vocab_size=TOK.vocab_size, embed_dim=32, mlp_dim=48, num_layers=1, num_heads=2, num_kv_heads=1,
  head_dim=16, vocab_multiple=8,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
  return model_lib.Decoder(CFG, rngs=nnx.Rngs(0))


def _generate(model, spec, record):
  graphdef, state = nnx.split(model)
  fn = engine.make_generate_fn(graphdef, spec)

  def generate(cache, *args):
    out, cache = fn(state, cache, *args)
    record.append(jax.device_get(out))
    return out, cache

  return generate


def _play(
  model, cfg, episodes, game="tic_tac_toe", temperature=1.0, max_new=6, cache_len=0, resize=None,
  envs=None,
):  # fmt: skip
  envs = envs or [env_lib.make(game, parse_mode="lenient") for _ in range(cfg.num_slots)]
  fmt = turn_format.PlainFormat(TOK)
  strategy = sampling.Temperature(temperature) if temperature else sampling.Greedy()
  spec = engine.GenerationSpec.with_stop_ids(
    TOK.stop_ids, strategy=strategy, max_new_tokens=max_new
  )
  record = []
  cache = model_lib.init_cache(CFG, cfg.num_slots, cache_len or cfg.cache_len())
  result, _ = rollout.run_rollout(
    _generate(model, spec, record),
    cache,
    envs,
    fmt,
    episodes,
    cfg,
    jax.random.key(0),
    pad_id=TOK.pad_id,
    resize=resize,
  )
  return result, record


def test_cache_grown_mid_run_gives_the_outputs_of_a_fixed_full_cache(model):
  cfg = rollout.RolloutConfig(num_slots=3, max_turns=6, max_new_tokens=6, max_context=512)
  episodes = [rollout.EpisodeSpec(seed=s, group_id=s) for s in range(5)]
  fixed, _ = _play(model, cfg, episodes, game="connect_four", temperature=0)
  sizes = []

  def resize(cache, need):
    sizes.append(max(64, 1 << (need - 1).bit_length()))  # geometric buckets, as the stages do
    return model_lib.resize_cache(cache, sizes[-1])

  grown, _ = _play(
    model, cfg, episodes, game="connect_four", temperature=0, cache_len=64, resize=resize
  )
  assert len(sizes) >= 2 and sizes == sorted(sizes) and sizes[-1] < cfg.cache_len()
  a, b = fixed.batch, grown.batch
  np.testing.assert_array_equal(a.tokens_BxT, b.tokens_BxT)
  np.testing.assert_array_equal(a.loss_mask_BxT, b.loss_mask_BxT)
  np.testing.assert_allclose(a.sampler_logps_BxT, b.sampler_logps_BxT, atol=1e-5)
  assert [e.outcome for e in fixed.episodes] == [e.outcome for e in grown.episodes]


def test_resize_cache_keeps_rows_and_drops_only_empty_slots():
  cache = model_lib.init_cache(CFG, 2, 8)
  cache = cache.replace(
    k=cache.k.at[:, :, :, :3].set(1.0),
    valid_BxS=cache.valid_BxS.at[:, :3].set(True),
    end_B=cache.end_B + 3,
  )
  big = model_lib.resize_cache(cache, 16)
  assert big.k.shape[3] == 16 and big.valid_BxS.shape == (2, 16)
  np.testing.assert_array_equal(big.k[:, :, :, :8], cache.k)
  assert not big.valid_BxS[:, 8:].any() and not big.k[:, :, :, 8:].any()
  small = model_lib.resize_cache(big, 4)
  np.testing.assert_array_equal(small.k, cache.k[:, :, :, :4])
  np.testing.assert_array_equal(small.end_B, [3, 3])


def test_batch_is_exactly_the_sampled_tokens_interleaved_with_env_tokens(model):
  cfg = rollout.RolloutConfig(num_slots=3, max_turns=4, max_new_tokens=6, max_context=256)
  episodes = [rollout.EpisodeSpec(seed=s, group_id=s // 2) for s in range(5)]  # 5 > 3 slots: refill
  result, record = _play(model, cfg, episodes)
  b = result.batch
  assert b.tokens_BxT.shape[0] == 5 and b.tokens_BxT.shape[1] % cfg.seq_multiple == 0
  sampled = [
    int(x) for out in record for row in range(3) for x in out.tokens_BxN[row][out.mask_BxN[row]]
  ]
  trained = [int(x) for e in range(5) for x in b.tokens_BxT[e][b.loss_mask_BxT[e]]]
  # Every sampled token is trained on, and nothing else is (as a multiset over the whole batch).
  assert sorted(sampled) == sorted(trained) and len(trained) == sum(
    int(o.lengths_B.sum()) for o in record
  )
  for e, stats in enumerate(result.episodes):
    n = stats.context_len
    assert b.valid_BxT[e].sum() == n and b.valid_BxT[e, :n].all()
    assert not b.loss_mask_BxT[e, n:].any()
    # The first prompt is the format's encoding of the env text; it is not a model token.
    env = env_lib.make("tic_tac_toe", parse_mode="lenient")
    first = turn_format.PlainFormat(TOK).first(env.instructions, env.reset(stats.seed))
    np.testing.assert_array_equal(b.tokens_BxT[e, : len(first)], first)
    assert not b.loss_mask_BxT[e, : len(first)].any()
    assert stats.turns >= 1 and stats.outcome
  np.testing.assert_array_equal(b.group_ids_B, [0, 0, 1, 1, 2])
  np.testing.assert_allclose(b.rewards_B, [s.reward for s in result.episodes])
  np.testing.assert_allclose(b.token_rewards_BxT.sum(1), b.rewards_B, atol=1e-6)


class _Tactics:
  """A game env that keeps, per episode seed, the tactic its every step named. Every reply is
  played as a legal column picked from its text (a random model's replies are rarely moves)."""

  def __init__(self, env, seen: dict[int, list]) -> None:
    self.env, self.seen = env, seen

  def __getattr__(self, name: str):
    return getattr(self.env, name)

  def reset(self, seed: int) -> str:
    self.seed, self.seen[seed] = seed, []
    return self.env.reset(seed)

  def step(self, action_text: object):
    legal = self.env.state.legal_actions()
    result = self.env.step(str(legal[sum(map(ord, str(action_text))) % len(legal)]))
    self.seen[self.seed].append(result.info.get("tactic"))
    return result


def test_episode_stats_count_each_named_tactic_and_keep_the_last_moves(model):
  cfg = rollout.RolloutConfig(num_slots=4, max_turns=24, max_new_tokens=6, max_context=1024)
  seen: dict[int, list] = {}
  envs = [
    _Tactics(env_lib.make("connect_four", parse_mode="lenient", opponent="heuristic"), seen)
    for _ in range(4)
  ]
  episodes = [rollout.EpisodeSpec(seed=s, group_id=0) for s in range(12)]
  result, _ = _play(model, cfg, episodes, envs=envs)
  for stats in result.episodes:
    named = [t for t in seen[stats.seed] if t]
    assert stats.tactics == {t: named.count(t) for t in set(named)}
    assert stats.last_tactic == (seen[stats.seed][-1] or "")
  # Not vacuous: the heuristic's threats and the random replies made tactics, some of them last.
  assert sum(sum(s.tactics.values()) for s in result.episodes) > 0
  assert any(s.last_tactic for s in result.episodes)


def test_sampler_logps_equal_rescoring_the_packed_episodes(model):
  """The KV cache carried across turns gives the log-probs of scoring each episode from scratch."""
  cfg = rollout.RolloutConfig(num_slots=2, max_turns=3, max_new_tokens=5, max_context=256)
  result, _ = _play(model, cfg, [rollout.EpisodeSpec(seed=s, group_id=s) for s in range(3)])
  b = result.batch
  assert max(s.turns for s in result.episodes) >= 2  # continuation really happened
  scored, _ = reference.token_logps(
    model, b.tokens_BxT, b.positions_BxT, b.valid_BxT, chunk_size=64
  )
  mask = b.loss_mask_BxT
  np.testing.assert_allclose(np.asarray(scored)[mask], b.sampler_logps_BxT[mask], atol=5e-5)


def test_context_limit_truncates_and_marks_without_crashing(model):
  cfg = rollout.RolloutConfig(num_slots=2, max_turns=8, max_new_tokens=8, max_context=200)
  result, _ = _play(
    model, cfg, [rollout.EpisodeSpec(seed=s, group_id=0) for s in range(4)], game="connect_four"
  )
  for stats in result.episodes:
    assert stats.context_len <= 200
  truncated = [s for s in result.episodes if s.truncated]
  assert truncated and all(s.outcome in ("truncated", "max_turns") for s in truncated)
  assert result.batch.tokens_BxT.shape[1] <= 256


def test_rejects_mismatched_env_count(model):
  cfg = rollout.RolloutConfig(num_slots=2)
  with pytest.raises(ValueError, match="one env per slot"):
    rollout.run_rollout(None, None, [], None, [], cfg, jax.random.key(0), pad_id=0)


def _play_continuous(model, cfg, episodes, game="connect_four", max_new=6, cache_len=0, steps=3):
  """``_play`` (greedy) through the continuous-batching rollout."""
  envs = [env_lib.make(game, parse_mode="lenient") for _ in range(cfg.num_slots)]
  spec = engine.GenerationSpec.with_stop_ids(TOK.stop_ids, max_new_tokens=max_new)
  graphdef, params = nnx.split(model)
  programs = slots.SlotPrograms(graphdef, spec, steps=steps)
  cache = model_lib.init_cache(CFG, cfg.num_slots, cache_len or cfg.cache_len())
  state = programs.new_state(cache, CFG.padded_vocab_size, jax.random.key(0))
  result, _ = rollout.run_rollout_continuous(
    programs.bind(params),
    state,
    envs,
    turn_format.PlainFormat(TOK),
    episodes,
    cfg,
    jax.random.key(0),
    pad_id=TOK.pad_id,
  )
  return result


@pytest.mark.parametrize(
  ("game", "max_new", "steps"), [("connect_four", 6, 3), ("tic_tac_toe", 9, 1)]
)
def test_continuous_rollout_plays_the_turn_rollouts_episodes_under_greedy(
  model, game, max_new, steps
):
  """Same episodes, token for token, as the turn-synchronous rollout: slots refilled at other
  times, prefills of other row counts, env steps on worker threads change nothing."""
  cfg = rollout.RolloutConfig(num_slots=3, max_turns=5, max_new_tokens=max_new, max_context=256)
  episodes = [rollout.EpisodeSpec(seed=s, group_id=s // 2) for s in range(7)]
  turn, _ = _play(model, cfg, episodes, game=game, temperature=0, max_new=max_new)
  cont = _play_continuous(model, cfg, episodes, game=game, max_new=max_new, steps=steps)
  for key in ("tokens_BxT", "valid_BxT", "loss_mask_BxT", "token_rewards_BxT", "rewards_B"):
    np.testing.assert_array_equal(getattr(cont.batch, key), getattr(turn.batch, key), err_msg=key)
  np.testing.assert_allclose(cont.batch.sampler_logps_BxT, turn.batch.sampler_logps_BxT, atol=2e-5)
  assert [e.outcome for e in cont.episodes] == [e.outcome for e in turn.episodes]
  assert cont.generated_tokens == turn.generated_tokens


def test_continuous_rollout_truncates_at_the_context_budget_like_the_turn_rollout(model):
  cfg = rollout.RolloutConfig(num_slots=2, max_turns=30, max_new_tokens=6, max_context=120)
  episodes = [rollout.EpisodeSpec(seed=s, group_id=s) for s in range(3)]
  turn, _ = _play(model, cfg, episodes, game="connect_four", temperature=0)
  cont = _play_continuous(model, cfg, episodes)
  assert [(e.outcome, e.truncated, e.context_len) for e in cont.episodes] == [
    (e.outcome, e.truncated, e.context_len) for e in turn.episodes
  ]
  assert any(e.truncated for e in cont.episodes)
  np.testing.assert_array_equal(cont.batch.tokens_BxT, turn.batch.tokens_BxT)


def test_rollout_config_names_the_batching_modes():
  with pytest.raises(ConfigError, match=r"batching.*'async'.*\['turn', 'continuous'\]"):
    rollout.RolloutConfig(batching="async")
  with pytest.raises(ConfigError, match="decode_steps"):
    rollout.RolloutConfig(decode_steps=0)
