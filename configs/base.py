"""The full config schema of earl_jax: every key, its one default and a one-line comment.

Experiment files derive from this (``config = base.get_config()`` then override); they never
declare new keys. ``earl_jax.config_lib.from_config_dict`` validates the result before any compute.

Launch: python launch/train.py --config=configs/base.py
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # root PRNG seed: params init, sampling and environment seeds derive from it
  c.pretrained_path = (
    ""  # HF directory or hub repo id; when set, `model` is read from its config.json
  )

  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 256  # tokenizer vocabulary size (embedding rows before padding)
  m.embed_dim = 64  # D: residual stream width (HF hidden_size)
  m.mlp_dim = 128  # F: SwiGLU hidden width (HF intermediate_size)
  m.num_layers = 2  # L: decoder blocks
  m.num_heads = 4  # H: query heads
  m.num_kv_heads = 2  # K: key/value heads; must divide num_heads (grouped-query attention)
  m.head_dim = 16  # Dh: per-head width; even (RoPE rotates pairs)
  m.rms_norm_eps = 1e-6  # RMSNorm epsilon
  m.qkv_bias = False  # biases on q/k/v projections (Qwen2 uses them)
  m.tie_embeddings = False  # output projection shares the embedding table
  m.max_seq_len = 2048  # longest context (prompt + every turn) the model is asked to handle
  m.vocab_multiple = 128  # embedding rows are padded up to a multiple of this (tensor parallelism)
  m.param_dtype = "float32"  # master weights and Adam moments: float32 | bfloat16 (pure bf16)
  m.compute_dtype = "float32"  # matmul dtype: float32 | bfloat16 (softmax and norms stay float32)
  m.attention = "auto"  # auto | naive | chunked (O(T) memory) | cudnn (GPU) | splash (TPU)
  m.attention_block = 512  # max query/key block of the chunked (sized evenly) and splash kernels
  m.forward_layers = "auto"  # full-sequence forward: scan (depth-free compile) | unrolled | auto
  m.decode_layers = "auto"  # decode loop: scan | unrolled (weights sliced once per call) | auto

  r = m.rope = ml_collections.ConfigDict()
  r.theta = 10000.0  # RoPE base (HF rope_theta)
  r.type = "default"  # default | llama3 (Llama-3.1 frequency scaling)
  r.factor = 8.0  # llama3: wavelength scaling factor
  r.low_freq_factor = 1.0  # llama3: low-frequency factor
  r.high_freq_factor = 4.0  # llama3: high-frequency factor
  r.original_max_position_embeddings = 8192  # llama3: context length of the base model

  t = c.tokenizer = ml_collections.ConfigDict()
  t.kind = "char"  # char (built-in, no files) | hf (tokenizer.json from `path`)
  t.path = ""  # hf: directory or hub repo id with tokenizer.json; "" = pretrained_path

  e = c.env = ml_collections.ConfigDict()
  e.name = "connect_four"  # connect_four | tic_tac_toe | calculator
  g = e.game = ml_collections.ConfigDict()  # board games (OpenSpiel)
  g.opponent = "random"  # training opponent: random | first_legal | heuristic | mcts
  g.opponent_mix = ()  # or several, one drawn per episode (group): e.g. ("random", "heuristic")
  g.mcts_simulations = 50  # mcts opponent: simulations per move
  g.mcts_rollouts = 1  # mcts opponent: random rollouts per leaf
  g.mcts_uct_c = 2.0  # mcts opponent: exploration constant
  g.model_side = "alternate"  # first | second | alternate (by episode seed parity)
  g.observation = "compact"  # compact (board + last move) | verbose (chat) | moves | columns|lines
  g.parse_mode = "tag"  # tag (<move>N</move> only) | lenient (else the first digit run)
  g.action_tag = "move"  # the answer is <action_tag>N</action_tag>
  g.on_invalid = "retry"  # after an invalid answer: end the episode | retry
  g.max_retries = 2  # retry: invalid answers in a row before the episode ends as invalid
  g.invalid_penalty = -0.5  # reward of each invalid answer that is asked again
  g.legal_move_reward = 0.0  # reward of each legal move (a survival signal for from-scratch runs)
  g.survival_reward = 0.0  # per legal move, and on a win per move left: rewards holding off a loss
  g.tactic_reward = 0.0  # per move that takes a win on offer, else blocks one (shaping reward)
  g.expert = "one_ply"  # imitation labels: one_ply (wins, else blocks) | two_ply (+ safe moves)
  g.forfeit_reward = -0.5  # reward of the invalid answer that ends the episode; < loss_reward
  g.win_reward = 1.0
  g.draw_reward = 0.0
  g.loss_reward = -1.0
  k = e.calculator = ml_collections.ConfigDict()  # tool use: arithmetic with a calculator
  k.kinds = ("arithmetic", "word")  # problem kinds to draw from
  k.min_ops = 2  # operators per arithmetic problem, at least
  k.max_ops = 3  # ... and at most
  k.max_operand = 20  # operands drawn from 1..max_operand
  k.max_turns = 4  # policy turns (tool calls included) before the episode is cut
  k.tolerance = 1e-6  # absolute tolerance of a correct answer
  k.correct_reward = 1.0
  k.wrong_reward = 0.0
  k.malformed_penalty = -0.1  # reward of an unparseable turn
  k.on_malformed = "retry"  # end | retry
  k.observation = "compact"  # compact | verbose

  s = c.sampler = ml_collections.ConfigDict()
  s.strategy = "temperature"  # training rollouts: greedy | temperature | top_k | top_p
  s.temperature = 1.0  # softmax temperature (also used to score the behaviour policy)
  s.top_k = 0  # top_k strategy: candidates kept
  s.top_p = 1.0  # top_p strategy: nucleus mass
  s.eval_strategy = "greedy"  # evaluation games: greedy | temperature | top_k | top_p
  s.restrict_answers = False  # each answer is one token of the env's answer alphabet (a game's
  # moves; env.game.parse_mode lenient, rollout.max_new_tokens 1); the loss scores the same
  # restricted distribution. Legality is still the policy's to learn, unless:
  s.legal_answers = False  # with restrict_answers: each turn decodes only the moves legal in that
  # position (action masking; the env names them), scored the same way; rollout.batching turn

  r = c.rollout = ml_collections.ConfigDict()
  r.num_slots = 8  # episodes decoded concurrently (rows of the rollout batch)
  r.max_turns = 8  # model turns per episode before it is cut (outcome max_turns)
  r.max_new_tokens = 16  # tokens per model turn
  r.max_context = 512  # token budget of one episode; longer episodes are truncated and marked
  r.chunk_multiple = 16  # new-context chunks are padded to a multiple (bounds recompiles)
  r.seq_multiple = 64  # packed episodes are padded to a multiple (the length bucket unit)
  # turn: each device call decodes a whole turn for every slot, then the envs step in turn;
  # continuous: a slot whose turn ends leaves the batch, its env steps on a worker thread while
  # the others decode, and its next chunk is inserted after the next call (long-tailed turns).
  r.batching = "turn"
  r.decode_steps = 4  # continuous: tokens per device call between slot refills (a finished turn
  # waits one call for its next chunk; 4 was fastest of 2, 4, 8, 16 on benchmarks/rollout.py)

  rl = c.rl = ml_collections.ConfigDict()
  rl.num_groups = 8  # P: initial states (prompts) per step
  rl.group_size = 4  # G: episodes per initial state; the batch is P * G episodes
  rl.logp_chunk = 64  # sequence chunk of log-prob computation; divides rollout.seq_multiple
  rl.ppo_epochs = 1  # passes over each rollout batch (PPO epochs)
  rl.mini_batches = 1  # optimiser steps per pass; > 1 step in all makes the loop score pi_old
  rl.imitation_steps = 0  # steps that record the expert's labels (rl.loss.imitation_coef); 0 = all
  a = rl.advantage = ml_collections.ConfigDict()
  a.estimator = "grpo"  # grpo | rloo | reinforce_pp (the EARL paper's)
  a.scale_by_std = True  # grpo: divide by the group std (False = Dr. GRPO)
  a.whiten = config_dict.placeholder(bool)  # global whitening; None = the estimator's default
  a.eps = 1e-6  # added to every std
  a.kl_beta = 0.0  # reinforce_pp: beta of the KL penalty folded into the reward
  a.kl_estimator = "k1"  # reinforce_pp: k1 | k2 | k3
  a.gamma = 1.0  # reinforce_pp: discount per policy token
  a.per_turn_rewards = False  # reinforce_pp: one reward per turn instead of per episode
  lo = rl.loss = ml_collections.ConfigDict()
  lo.clip_eps_low = 0.2  # epsilon_low: ratio clipped below at 1 - eps
  lo.clip_eps_high = 0.2  # epsilon_high: ratio clipped above at 1 + eps (0.28 = clip-higher)
  lo.dual_clip = config_dict.placeholder(float)  # c > 1 bounds negative-advantage losses; None off
  lo.kl_beta = 0.0  # beta of KL(pi || pi_ref) in the loss (GRPO); 0 = no reference term
  lo.kl_estimator = "k3"  # in-loss KL estimator: k1 | k2 | k3
  lo.entropy_coef = 0.0  # entropy bonus weight
  lo.aggregation = "token_mean"  # token_mean | seq_mean_token_mean | seq_sum_norm
  lo.seq_sum_norm = config_dict.placeholder(int)  # seq_sum_norm constant; None = padded length
  # Imitation term: -log pi(the env's scripted expert's answers) on the turns it labels (games:
  # a win on offer, else a block), per policy token; needs sampler.restrict_answers. 0 = off.
  lo.imitation_coef = 0.0

  o = c.optim = ml_collections.ConfigDict()
  o.learning_rate = 1e-5  # peak learning rate
  o.warmup_steps = 0  # linear warmup, in optimiser steps (rl.ppo_epochs * rl.mini_batches a step)
  o.decay_steps = 1000  # cosine decay optimiser steps after warmup
  o.end_lr_ratio = 0.1  # final learning rate / peak
  o.weight_decay = 0.0  # decoupled AdamW weight decay
  o.b1 = 0.9  # Adam beta1
  o.b2 = 0.999  # Adam beta2
  o.eps = 1e-8  # Adam epsilon
  o.max_grad_norm = 1.0  # global-norm clipping; 0 = off

  p = c.parallel = ml_collections.ConfigDict()
  p.num_devices = 0  # devices every stage uses; 0 = all
  p.selector = False  # True: the parallelism selector picks each stage's layout per length bucket
  p.memory_budget_gib = 0.0  # per-device memory budget; 0 = from device.memory_stats()
  for stage in ("rollout", "reference", "update"):
    lay = p[f"{stage}_layout"] = ml_collections.ConfigDict()  # the fixed layout of this stage
    lay.data = -1  # data-parallel size; -1 = the devices left after fsdp and tensor
    lay.fsdp = 1  # parameter-sharding size
    lay.tensor = 1  # tensor-parallel size
    lay.micro_batch_size = 0  # update: sequences per micro-batch (0 = the whole mini-batch)
    lay.remat = "none"  # update: activation rematerialisation none | full | dots

  tr = c.train = ml_collections.ConfigDict()
  tr.num_steps = 100  # training steps (one rollout + one update each)
  tr.eval_every = 10  # evaluate every N steps, and at the first and last; 0 = never
  tr.eval_episodes = 32  # evaluation episodes per opponent
  tr.final_eval_episodes = 0  # ... at the last step (the final figure); 0 = eval_episodes
  tr.eval_opponents = ("random",)  # board games: random | first_legal | heuristic | mcts | mcts:N
  tr.baselines = ()  # scripted policies, played once at start: random | column | stack | heuristic
  # | mcts:N (reference lines of the eval curves)
  tr.checkpoint_every = 20  # checkpoint every N steps (and at the end and on SIGTERM)
  tr.keep_checkpoints = 2  # checkpoints kept
  tr.log_every = 1  # metrics every N steps
  tr.max_nonfinite_steps = 10  # stop, saving the last good state, after N skipped steps in a row
  tr.profile_steps = ()  # steps traced with jax.profiler into <workdir>/profile (TensorBoard)
  return c
