"""A reward model (a tiny Llama sequence classifier saved in tmp_path) scoring in its own Ray actor on a real local
cluster: its batched, right-padded scores equal the model's own unpadded forward in this process; a classifier of
two labels is refused."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import ray
import torch
from _tiny_classifier import save_classifier

from screl.envs import PromptRecord
from screl.rewards import PROMPT_MESSAGES, RewardFuncError, RewardFuncs, RewardModel


def _own_scores(model: torch.nn.Module, tok: object, texts: list[str]) -> list[float]:
    out = []
    with torch.no_grad():
        for text in texts:  # one at a time: no padding at all
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])  # type: ignore[operator]
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_actor_scores_equal_the_models_own_forward(tmp_path: Path, ray_cluster: None) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tiny_rm"
    model = save_classifier(path)
    tok = AutoTokenizer.from_pretrained(path)
    rm = RewardModel(path=str(path), batch_size=2)
    assert rm.__name__ == "tiny_rm"
    records = [PromptRecord(i, p, {}) for i, p in enumerate(["1+1=", "12+30=", "7+8=", "abc"])]
    completions = ["2", "42 and more", "15", "xyz 9"]  # unequal lengths: the actor's batches are padded
    funcs = RewardFuncs([rm], reward_weights=[2.0])
    totals, values = funcs.score(records, completions, [[0]] * 4)
    expected = _own_scores(model, tok, [r.text + c for r, c in zip(records, completions, strict=True)])
    assert len(set(expected)) == 4, "the random model must tell the samples apart"
    assert values["tiny_rm"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert totals == pytest.approx([2 * e for e in expected], rel=1e-5, abs=1e-5)

    chat = [PromptRecord(9, "ignored", {PROMPT_MESSAGES: [{"role": "user", "content": "1+2"}]})]
    rendered = tok.apply_chat_template([{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}],
                                       tokenize=False)
    assert funcs.score(chat, ["3"], [[0]]).values["tiny_rm"] == pytest.approx(
        _own_scores(model, tok, [rendered]), rel=1e-5, abs=1e-5)

    again = pickle.loads(pickle.dumps(rm))  # what a rollout worker receives: no handle, the same named actor
    assert again._actor is None
    assert again(["1+1="], ["2"]) == pytest.approx(expected[:1], rel=1e-5, abs=1e-5)
    assert again.actor()._actor_id == rm.actor()._actor_id
    rm.close()  # the session's later fits check that no screl actor is left over
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if "screl-reward-model" in str(a)]


def test_a_reward_model_of_two_labels_is_refused(tmp_path: Path) -> None:
    save_classifier(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardFuncError, match=r"num_labels=2: a reward model gives one score per sample"):
        RewardModel(path=str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"device='cuda'\) needs num_gpus > 0"):
        RewardModel(path=str(tmp_path / "two"), device="cuda", num_gpus=0)


def test_a_reward_model_by_hub_id_resolves_from_the_cache_or_is_named() -> None:
    """The suite runs offline (HF_HUB_OFFLINE=1): an id not in the cache is refused when the object is built."""
    from screl.rewards import RewardModel

    with pytest.raises(FileNotFoundError, match=r"RewardModel: path='org/absent-rm' is no local directory, and as a "
                                                r"hub id it is not in the Hugging Face cache .* HF_HUB_OFFLINE=1"):
        RewardModel("org/absent-rm")
