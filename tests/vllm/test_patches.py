"""The patch set over vLLM's runner (calib.vllm.patches) on stand-in classes (no vLLM): two subscribers
hear every event in their declared order, the first outermost; each method is wrapped once."""

import types

import pytest
import torch

from calib.vllm.patches import HOOKED, PatchSet, RunnerSubscriber


class Runner:
    """Stand-in for GPUModelRunner: each method counts its calls."""

    calls: list

    def take_draft_token_ids(self):
        self.calls.append("take")
        return ["vllm lists"]

    def _sample(self, logits, spec_decode_metadata):
        self.calls.append("sample")
        return types.SimpleNamespace(sampled_token_ids=torch.tensor([[1, -1]]))

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args):
        self.calls.append("propose")
        return "drafts"

    def _update_states(self, scheduler_output):
        self.calls.append("update")


class Proposer:
    """Stand-in for SpecDecodeBaseProposer on its plain greedy path."""

    _enable_probabilistic_draft_probs = False
    use_local_argmax_reduction = False
    use_heterogeneous_vocab = False

    def __init__(self, logits):
        self.model = types.SimpleNamespace(compute_logits=lambda h: logits)

    def _greedy_sample(self, hidden_states):
        raise AssertionError("the patch set recomputes the argmax itself")

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        raise AssertionError("not reached on the greedy path while someone listens")

    def propose(self, num_speculative_tokens, *args, **kwargs):
        return "drafted"


class Log(RunnerSubscriber):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def before_take(self, runner):
        self.log.append((self.name, "before_take"))

    def take_drafts(self, runner, out):
        self.log.append((self.name, "take_drafts"))
        return [*out, self.name]

    def before_verify(self, runner):
        self.log.append((self.name, "before_verify"))

    def after_verify(self, runner, spec_decode_metadata, output):
        self.log.append((self.name, "after_verify"))

    def before_propose(self, runner, scheduler_output, sampled_token_ids):
        self.log.append((self.name, "before_propose"))

    def after_propose(self, runner):
        self.log.append((self.name, "after_propose"))

    def wants_depths(self):
        return True

    def draft_depth(self, token_ids, probs, max_q):
        self.log.append((self.name, "draft_depth", token_ids.tolist(), probs.shape))

    def before_update_states(self, runner, scheduler_output):
        self.log.append((self.name, "before_update_states"))


class UnitaryKVCacheCoordinator:
    """Stand-in for vLLM's one-group coordinator: the drop of the head's block is read from eagle_group_ids."""

    def __init__(self, eagle):
        self.eagle_group_ids = {0} if eagle else set()


class CacheManager:
    """Stand-in for KVCacheManager: a prompt's cache hit, one 128-token block less where the head's block drops."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def get_computed_blocks(self, request):
        hit = (request.num_tokens - 1) // 128 * 128
        return None, max(0, hit - 128) if 0 in self.coordinator.eagle_group_ids else hit, 0


@pytest.fixture
def patched():
    runner_cls = type("R", (Runner,), {})
    proposer_cls = type("P", (Proposer,), {})
    cache_cls = type("C", (CacheManager,), {})
    log = []
    ps = PatchSet([Log("serving", log), Log("capture", log)])
    ps.install(runner_cls, proposer_cls, cache_cls)
    yield runner_cls, proposer_cls, ps, log
    ps.uninstall(runner_cls, proposer_cls, cache_cls)


def test_subscribers_hear_events_in_declared_order(patched):
    runner_cls, _, _, log = patched
    runner = runner_cls()
    runner.calls = []
    assert runner.propose_draft_token_ids("sched", [[1]]) == "drafts"
    runner._sample(None, object())
    out = runner.take_draft_token_ids()
    runner._update_states("sched")
    assert runner.calls == ["propose", "sample", "take", "update"]  # each original called once
    events = [e[1] for e in log]
    assert events == ["before_propose", "before_propose", "after_propose", "after_propose",
                      "before_verify", "before_verify", "after_verify", "after_verify",
                      "before_take", "before_take", "take_drafts", "take_drafts",
                      "before_update_states", "before_update_states"]
    names = [e[0] for e in log]
    # before events in the declared order, after events in reverse (the first subscriber outermost)
    assert names == ["serving", "capture", "capture", "serving"] * 3 + ["serving", "capture"]
    assert out == ["vllm lists", "capture", "serving"]  # the outermost has the last word


def test_greedy_depth_is_computed_once_for_every_listener(patched):
    _, proposer_cls, _, log = patched
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    token_ids, probs = proposer_cls(logits)._sample_draft_tokens(None, types.SimpleNamespace(all_greedy=True))
    assert token_ids.tolist() == [1, 0] and probs is None  # vLLM's own argmax, no draft probabilities
    assert log == [("serving", "draft_depth", [1, 0], (2, 3)), ("capture", "draft_depth", [1, 0], (2, 3))]


def test_a_listener_of_max_q_alone_gets_no_vocabulary_softmax():
    """Serving needs max q only: with no listener asking for the distribution the patch set passes
    ``probs=None`` and max q = exp(max - logsumexp), the softmax's largest value."""
    from calib.vllm.patches import greedy_distribution

    heard = []

    class MaxOnly(RunnerSubscriber):
        def wants_depths(self):
            return True

        def wants_distribution(self):
            return False

        def draft_depth(self, token_ids, probs, max_q):
            heard.append((probs, max_q))

    proposer_cls = type("P", (Proposer,), {})
    PatchSet([MaxOnly()]).install(type("R", (Runner,), {}), proposer_cls)
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    token_ids, _ = proposer_cls(logits)._sample_draft_tokens(None, types.SimpleNamespace(all_greedy=True))
    (probs, max_q), = heard
    assert probs is None and token_ids.tolist() == [1, 0]
    assert torch.allclose(max_q, torch.softmax(logits, -1).amax(-1))
    full, full_max = greedy_distribution(logits, True)
    assert torch.allclose(full_max, max_q) and torch.allclose(full.sum(-1), torch.ones(2))


def test_each_method_is_wrapped_once(patched):
    runner_cls, proposer_cls, ps, _ = patched
    assert set(ps.originals) == set(HOOKED)
    for (owner, name), orig in ps.originals.items():
        assert orig is getattr({"runner": Runner, "proposer": Proposer, "cache": CacheManager}[owner], name)
    with pytest.raises(RuntimeError, match="already patched"):
        PatchSet([]).install(runner_cls, proposer_cls)


def test_uninstall_restores_the_originals():
    runner_cls, proposer_cls = type("R", (Runner,), {}), type("P", (Proposer,), {})
    ps = PatchSet([RunnerSubscriber()])
    ps.install(runner_cls, proposer_cls)
    ps.uninstall(runner_cls, proposer_cls)
    assert runner_cls._sample is Runner._sample and proposer_cls._sample_draft_tokens is Proposer._sample_draft_tokens


class Keeps(RunnerSubscriber):
    def __init__(self, keep):
        self.keep, self.asked = keep, []

    def keeps_head_block(self, request_id):
        self.asked.append(request_id)
        return self.keep


@pytest.mark.parametrize("votes, eagle, coordinator, hit", [
    ((True,), True, "UnitaryKVCacheCoordinator", 384),  # kept: the hit an engine without a head gets
    ((True, True), True, "UnitaryKVCacheCoordinator", 384),
    ((True, False), True, "UnitaryKVCacheCoordinator", 256),  # one subscriber says no: vLLM's drop
    ((), True, "UnitaryKVCacheCoordinator", 256),
    ((True,), False, "UnitaryKVCacheCoordinator", 384),  # no head: nothing to keep, nobody asked
    ((True,), True, "HybridKVCacheCoordinator", 256)])  # a drop per spec group: left as vLLM makes it
def test_the_cache_lookup_keeps_the_heads_block_only_when_every_subscriber_says_so(votes, eagle, coordinator, hit):
    cache_cls = type("C", (CacheManager,), {})
    subs = [Keeps(v) for v in votes]
    PatchSet(subs).install(type("R", (Runner,), {}), type("P", (Proposer,), {}), cache_cls)
    manager = cache_cls(type(coordinator, (UnitaryKVCacheCoordinator,), {})(eagle))
    request = types.SimpleNamespace(request_id="r1", num_tokens=500)
    assert manager.get_computed_blocks(request)[1] == hit
    assert manager.coordinator.eagle_group_ids == ({0} if eagle else set())  # put back
    asked = eagle and coordinator == "UnitaryKVCacheCoordinator"
    assert all(s.asked == (["r1"] if asked else []) for s in subs)
