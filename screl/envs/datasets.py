"""Prompts from a dataset read through Hugging Face ``datasets``: a local file or folder, or a hub dataset.

:class:`DatasetTask` reads one split (and optionally a second one for validation) and scores completions with a
:class:`~screl.envs.Verifier` (:class:`~screl.envs.MathVerify`) or a user function. Its configuration is its identity:
``path``, ``split``, ``data_files``, ``revision`` and the filters are init arguments, so they are part of the run
configuration and of the bootstrap fingerprint; a restart over a different dataset refuses the bootstrap restore and
names the changed key (``data.init_args.task.init_args.path: "old" -> "new"``).

At scale: the split stays the Arrow table ``datasets`` memory-maps; a prompt record is built from its row when it is
read (:class:`~screl.envs.dataset_records.Records`), each prompt is tokenized once when the run starts, and the
task travels to the controller and the workers without its rows (each process opens the dataset again, from the
``datasets`` cache).

``datasets`` comes with the ``tasks`` extra (``pip install 'screl[tasks]'``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from screl.envs.base import PromptKeys, PromptRecord, Scored, Task, Verifier, load_reward_fn
from screl.envs.dataset_columns import KEY, column
from screl.envs.dataset_images import ROW_REF, check_images, decode_images, image_base_dir
from screl.envs.dataset_load import load_table, release_arrow_memory
from screl.envs.dataset_prepare import (
    check_context,
    column_token_counts,
    context_positions,
    reads_as_is,
    token_counts,
    within_limit,
)
from screl.envs.dataset_records import (
    BATCH,
    Columns,
    Records,
    Render,
    Split,
    build_record,
    iter_rows,
    open_split,
    prompt_keys,
    prompt_text,
    text_columns,
)

if TYPE_CHECKING:
    from screl.models.spec import PolicySpec

__all__ = ["FILTER_REPORT", "KEY", "DatasetTask"]

FILTER_REPORT = "dataset_filter.json"
"""The file ``max_prompt_tokens`` writes under the run directory (kept and dropped counts per split)."""
_TRAIN, _VAL = "train", "val"


def _prompt_sources(prompt_column: str | None, messages_column: str | None, prompt_template: str | None) -> list[str]:
    """The prompt-source arguments given (at most one)."""
    given = [k for k, v in (("prompt_column", prompt_column), ("messages_column", messages_column),
                            ("prompt_template", prompt_template)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{KEY}: {' and '.join(given)} are both set; give exactly one prompt source")
    return given


def _check_scoring(verifier: Verifier | None, reward_fn: str | None, reward_funcs: Sequence[Any] | None,
                   max_prompt_tokens: int | None, holdout: int, val_split: str | None) -> None:
    """Exactly one scorer, a positive token limit, and one way of choosing the validation prompts."""
    given = [k for k, v in (("verifier", verifier), ("reward_fn", reward_fn), ("reward_funcs", reward_funcs)) if v]
    if len(given) != 1:
        raise ValueError(f"{KEY}: give exactly one of verifier (e.g. screl.envs.MathVerify), reward_fn"
                         f" ('package.module:function') and reward_funcs (TRL-style functions); got "
                         f"{', '.join(given) if given else 'none'}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"{KEY}.max_prompt_tokens={max_prompt_tokens} must be >= 1, or null for no limit")
    if holdout and val_split is not None:
        raise ValueError(f"{KEY}: holdout={holdout} and val_split={val_split!r} both choose the validation"
                         " prompts; set one of them")


def _reward_funcs(funcs: Sequence[Any] | None, weights: Sequence[float] | None) -> Any:
    """The TRL-style scorer (:class:`screl.rewards.RewardFuncs`) with the policy's tokenizer for completion ids."""
    if not funcs:
        if weights:
            raise ValueError(f"{KEY}.reward_weights={list(weights)} weigh reward_funcs, which is not set")
        return None
    from screl.rewards.funcs import RewardFuncs
    from screl.rewards.task import CompletionTokens

    return RewardFuncs(list(funcs), list(weights) if weights is not None else None), CompletionTokens()


def _held_rows(ids: np.ndarray, holdout: int) -> np.ndarray:
    """The rows of the ``holdout`` prompts kept back: the smallest by a fixed hash of their ids (as
    :func:`screl.envs.tasks.split_holdout` chooses them)."""
    import hashlib
    import heapq

    if not 0 <= holdout < len(ids):
        raise ValueError(f"holdout={holdout} must be in [0, {len(ids) - 1}] (the task has {len(ids)} prompts)")
    ranked = heapq.nsmallest(holdout, range(len(ids)),
                             key=lambda k: hashlib.sha256(f"holdout:{int(ids[k])}".encode()).digest())
    return np.asarray(sorted(ranked), dtype=np.int64)


class DatasetTask(Task):
    """Prompts from a dataset, each row one prompt, scored by a verifier or a reward function.

    The prompt is the ``prompt_column`` (default ``prompt``), or the ``messages_column``, or ``prompt_template``
    filled from the row (``"{question}"``); exactly one of them. A column is recognised by its type: text (TRL's
    standard format) is the prompt as is; a list of ``{role, content}`` messages (TRL's conversational format,
    verl's ``prompt``) is a chat, rendered with the policy tokenizer's chat template when the run starts (a last
    assistant message is left out: it is the reference completion, not the prompt); any other type is refused.
    Column names may be dotted into struct columns (``reward_model.ground_truth``). Every other column goes to the
    prompt's ``metadata`` (verl's ``extra_info`` as a dict), the reference answer also as ``metadata["answer"]``
    (what :class:`~screl.envs.MathVerify` reads) and the task source as ``metadata["task_source"]`` (what
    ``rollout_recovery.task_source_granularity_overrides`` keys on).

    Prompt ids are the ``id_column``'s integers, or its strings (each mapped to a stable 63-bit integer, the string
    kept as ``metadata["dataset_id"]``), else the row index within the split (stable as long as the split is).
    With ``val_split`` the held-out prompts are that split's rows, numbered within it.

    Args:
        path: A local file (``.parquet``, ``.jsonl``, ``.json``, ``.csv``, ``.arrow``), a local folder, a
            ``datasets`` builder name (``parquet``, ``json``... with ``data_files``) or a hub dataset
            (``openai/gsm8k``; needs the hub reachable, pin ``revision``).
        split: The training split.
        data_files: Passed to ``datasets.load_dataset`` (a file, a list, or ``{split: files}``).
        revision: The hub revision (a commit hash pins the data; part of the run's identity).
        name: The hub dataset's configuration (``main`` for ``openai/gsm8k``).
        prompt_column: Column holding the prompt: text, or a chat.
        messages_column: Column holding a chat (TRL's ``messages``).
        prompt_template: ``str.format`` template over the row's columns.
        answer_column: Column holding the reference answer (``metadata["answer"]``); None: no answer.
        id_column: Column holding a unique integer or string id per row; None: the row index.
        task_source_column: Column naming each row's task source (``metadata["task_source"]``; verl's
            ``data_source``).
        image_column: Column holding each row's image(s) for a vision-language policy (a path relative to the
            dataset file's folder, encoded bytes, a Hugging Face ``Image`` feature, or a list of them): checked when
            the dataset is read, decoded on the rollout worker (:meth:`images`); the prompt record holds only its
            row (``metadata["dataset_row"]``), never the image.
        system_prompt: With a chat, or text and ``chat_template``: a system turn before the prompt (unless its
            messages start with one).
        chat_template: Render each text prompt with the policy tokenizer's chat template (user turn, then the
            assistant's turn opened) when the run starts; the policy then must not template again
            (``HFCausalLM.chat_template: false``). False: the text as is (or templated by the policy). A chat is
            always rendered (with the policy's ``chat_template_kwargs``).
        max_prompt_tokens: Drop prompts longer than this many tokens under the policy's tokenizer (counted as the
            model sees them) when the run starts; the counts are logged and written to
            ``<run_dir>/dataset_filter.json``.
        holdout: Prompts of the training split kept back for validation (``val_prompts()``).
        val_split: A split whose rows are the validation prompts (instead of ``holdout``).
        verifier: Scores completions (:class:`~screl.envs.MathVerify`).
        reward_fn: Or a function ``"package.module:function"``, called as ``fn(prompt, completion) -> float``.
        reward_funcs: Or TRL-style reward functions (callables or ``"pkg.mod:fn"``, TRL's signature: the dataset's
            columns as keywords; a chat's messages as the prompts): :class:`screl.rewards.RewardFuncs`.
        reward_weights: One weight per reward function (default 1.0 each).
    """

    def __init__(
        self,
        path: str,
        split: str = "train",
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        revision: str | None = None,
        name: str | None = None,
        prompt_column: str | None = None,
        messages_column: str | None = None,
        prompt_template: str | None = None,
        answer_column: str | None = "answer",
        id_column: str | None = None,
        task_source_column: str | None = None,
        image_column: str | None = None,
        system_prompt: str | None = None,
        chat_template: bool = False,
        max_prompt_tokens: int | None = None,
        holdout: int = 0,
        val_split: str | None = None,
        verifier: Verifier | None = None,
        reward_fn: str | None = None,
        reward_funcs: Sequence[Any] | None = None,
        reward_weights: Sequence[float] | None = None,
    ) -> None:
        given = _prompt_sources(prompt_column, messages_column, prompt_template)
        _check_scoring(verifier, reward_fn, reward_funcs, max_prompt_tokens, holdout, val_split)
        self.path, self.split, self.data_files, self.revision, self.name = path, split, data_files, revision, name
        self.prompt_column = prompt_column if given else "prompt"
        self.messages_column, self.prompt_template = messages_column, prompt_template
        self.answer_column, self.id_column, self.task_source_column = answer_column, id_column, task_source_column
        self.image_column = image_column
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.max_prompt_tokens, self.holdout, self.val_split = max_prompt_tokens, holdout, val_split
        self.verifier, self.reward_fn = verifier, reward_fn
        self.reward_funcs, self.reward_weights = reward_funcs, reward_weights
        self._fn = load_reward_fn(reward_fn) if reward_fn is not None else None
        self._funcs = _reward_funcs(reward_funcs, reward_weights)
        self._cols = Columns(self.prompt_column if prompt_template is None and messages_column is None else None,
                             messages_column, prompt_template, answer_column, id_column, task_source_column,
                             image_column)
        self._source = os.path.abspath(path) if os.path.exists(path) else path  # the workers open it from anywhere
        self._splits: dict[str, Split] = {}  # not pickled: each process opens the dataset again
        self._rows: dict[str, np.ndarray] = {}  # role -> the selected rows (a cache, not pickled)
        self._num_rows: dict[str, int] = {}
        self._policy: PolicySpec | None = None  # the policy whose chat template renders the prompts (prepare)
        self._tokenizer: Any = None
        self._prepared_for: Any = None
        self._roles = self._choose(self._open(split, "split"))
        release_arrow_memory()

    # -- reading ---------------------------------------------------------------------------------------
    def _choose(self, train: Split) -> dict[str, tuple[str, np.ndarray]]:
        """The training and validation prompts: (split, which of its rows) each."""
        self._check_system_prompt(train)
        if self.val_split is not None:
            val = self._open(self.val_split, "val_split")
            return {_TRAIN: (self.split, np.ones(len(train), dtype=bool)), _VAL: (val.name, np.ones(len(val), bool))}
        held = np.zeros(len(train), dtype=bool)
        if self.holdout:
            held[_held_rows(train.ids_of(np.arange(len(train))), self.holdout)] = True
        return {_TRAIN: (self.split, ~held), _VAL: (self.split, held)}

    def _open(self, split: str, key: str) -> Split:
        """Read a split and check it (every row has its prompt and a unique id; the images exist)."""
        table = load_table(self._source, split, self.data_files, self.revision, self.name)
        opened = open_split(split, self.path, table, self._cols, key, check=True)
        if self.image_column is not None:
            base = image_base_dir(self._source)
            for index, row in iter_rows(table, np.arange(len(opened)), [self.image_column]):
                check_images(row[self.image_column], opened.where(index), self.image_column, base)
        self._splits[split], self._num_rows[split] = opened, len(opened)
        return opened

    def _check_system_prompt(self, train: Split) -> None:
        if self.system_prompt is not None and not self.chat_template and train.kind != "chat":
            raise ValueError(f"{KEY}.system_prompt needs {KEY}.chat_template: true or a chat prompt column (or set"
                             " the policy's own system_prompt with its chat_template)")

    def _split(self, name: str) -> Split:
        """The split, opened again in a process the task was sent to (from the ``datasets`` cache)."""
        opened = self._splits.get(name)
        if opened is None:
            table = load_table(self._source, name, self.data_files, self.revision, self.name)
            opened = open_split(name, self.path, table, self._cols, "split", check=False)
            if len(opened) != self._num_rows[name]:
                raise RuntimeError(f"{KEY}.path={self.path!r} (split {name!r}) has {len(opened)} rows here but had"
                                   f" {self._num_rows[name]} when the run started: the dataset changed under the"
                                   " run; give a changed dataset a new path (or pin its revision)")
            self._splits[name] = opened
        return opened

    def selected(self, role: str) -> np.ndarray:
        """The rows of the ``train`` or ``val`` prompts, in the split's order."""
        rows = self._rows.get(role)
        if rows is None:
            rows = self._rows[role] = np.flatnonzero(self._roles[role][1])
        return rows

    def _renderer(self) -> Render | None:
        """The chat template's rendering, once the run's policy is known (``prepare``)."""
        policy = self._policy
        if policy is None:
            return None
        from screl.models.spec import chat_prompt_text

        if self._tokenizer is None:
            self._tokenizer = policy.build_tokenizer()
        tokenizer, system, kwargs = self._tokenizer, self.system_prompt, policy.chat_template_kwargs

        def render(chat: list[dict[str, str]]) -> str:
            if system is not None and chat[0]["role"] != "system":
                chat = [{"role": "system", "content": system}, *chat]
            return chat_prompt_text(tokenizer, chat, kwargs)

        return render

    def records(self, role: str, rows: np.ndarray) -> Iterator[PromptRecord]:
        """The prompt records of these rows of the role's split, built as they are read."""
        split, render = self._split(self._roles[role][0]), self._renderer()
        for index, row in iter_rows(split.table, rows):
            yield build_record(split, self._cols, row, index,
                               prompt_text(split, self._cols, row, index, render, self.chat_template))

    def _texts(self, role: str, rows: np.ndarray | None = None) -> Iterator[list[str]]:
        """The prompt texts of the role's rows (or of these of them), ``BATCH`` at a time (reading only the columns
        they are made of)."""
        split, render = self._split(self._roles[role][0]), self._renderer()
        batch: list[str] = []
        chosen = self.selected(role) if rows is None else rows
        for index, row in iter_rows(split.table, chosen, text_columns(split, self._cols)):
            batch.append(prompt_text(split, self._cols, row, index, render, self.chat_template))
            if len(batch) == BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    # -- preparing for the run's policy -----------------------------------------------------------------
    def prepare(self, policy: PolicySpec, run_dir: str) -> None:
        """Once the policy is known: chats (and text, with ``chat_template``) are rendered with its tokenizer's
        chat template; each prompt is tokenized once, to drop the ones over ``max_prompt_tokens`` (the counts
        logged and written to ``<run_dir>/dataset_filter.json``) and to refuse one that fills the model's context.
        Idempotent for one policy."""
        if self._prepared_for == policy:
            return
        if self._funcs is not None:  # completions known only as text get their ids from the policy's tokenizer
            self._funcs[1].prepare(policy)
        limit = context_positions(policy)
        chats = any(self._split(name).kind == "chat" for name, _ in self._roles.values())
        renders = self.chat_template or chats
        if not (renders or self.max_prompt_tokens is not None or limit is not None):
            return
        if renders and getattr(policy, "chat_template", False):
            what = f"{KEY}.chat_template and" if self.chat_template else f"the chats of {self.path!r} (rendered by" \
                " DatasetTask with the tokenizer's chat template) and"
            raise ValueError(f"{what} model.init_args.policy.init_args.chat_template are both true: the prompt would be"
                             f" templated twice; set the policy's chat_template to false (its system_prompt: {KEY}"
                             ".system_prompt)")
        self._tokenizer = policy.build_tokenizer()
        self._policy = policy if renders else None
        if self.max_prompt_tokens is not None or limit is not None:
            self._filter(policy, run_dir, limit)
            release_arrow_memory()
        self._prepared_for = policy

    def _filter(self, policy: PolicySpec, run_dir: str, limit: int | None) -> None:
        report: dict[str, Any] = {"path": self.path, "max_prompt_tokens": self.max_prompt_tokens}
        for role in (_TRAIN, _VAL):
            name, mask = self._roles[role]
            rows, split = self.selected(role), self._split(name)
            where = f"{self.path!r} (split {name!r}"
            bound = min(x for x in (self.max_prompt_tokens, None if limit is None else limit - 1) if x is not None)
            counts = self._token_counts(policy, role, bound)
            ids = split.ids_of(rows)
            if self.max_prompt_tokens is not None:
                keep, report[role] = within_limit(counts, ids, self.max_prompt_tokens, where, role == _VAL)
                report[role] = {"split": name, **report[role]}
                counts, ids = counts[keep], ids[keep]
                mask = mask.copy()
                mask[rows[~keep]] = False
                self._roles[role] = (name, mask)
                self._rows.pop(role, None)
            if limit is not None:
                check_context(counts, ids, limit, where)
        if self.max_prompt_tokens is not None:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, FILTER_REPORT), "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)

    def _token_counts(self, policy: PolicySpec, role: str, bound: int) -> np.ndarray:
        """Each prompt's token count (:func:`~screl.envs.dataset_prepare.token_counts`). A text column the policy
        reads as is is bounded column-wide first (in Arrow; an ASCII text by one token a byte where the tokenizer
        allows it, checked on a sample): only the texts that could be over ``bound`` are read and tokenized."""
        split, rows = self._split(self._roles[role][0]), self.selected(role)
        if split.kind != "text" or split.prompt is None or self.chat_template or not reads_as_is(policy):
            return token_counts(policy, self._tokenizer, self._texts(role), len(rows), bound)
        return column_token_counts(self._tokenizer, column(split.table, split.prompt), rows, bound,
                                   lambda some: self._texts(role, some))

    # -- the task ---------------------------------------------------------------------------------------
    def prompts(self) -> Records:
        """The training prompts (less the held-out ones, and after ``prepare``, the ones too long), each built
        from its row as it is read."""
        return Records(self, _TRAIN)

    def prompt_index(self) -> Iterator[PromptKeys]:
        """What :meth:`prompts` gives of each training prompt's id and keys, read from those columns alone."""
        yield from prompt_keys(self._split(self._roles[_TRAIN][0]), self._cols, self.selected(_TRAIN))
        release_arrow_memory()

    def val_prompts(self) -> Records:
        """The ``val_split`` rows, or the ``holdout`` prompts kept back from the training split."""
        return Records(self, _VAL)

    def prompt(self, prompt_id: int) -> PromptRecord:
        """A training prompt by id (its row found by the id, not by a scan)."""
        return self._by_id(_TRAIN, prompt_id)

    def val_prompt(self, prompt_id: int) -> PromptRecord:
        """A held-out prompt by id."""
        return self._by_id(_VAL, prompt_id)

    def _by_id(self, role: str, prompt_id: int) -> PromptRecord:
        name, mask = self._roles[role]
        row = self._split(name).row_of(int(prompt_id))
        if row is None or not mask[row]:
            raise KeyError(f"DatasetTask has no {'held-out ' if role == _VAL else ''}prompt_id {prompt_id}.")
        return next(self.records(role, np.asarray([row], dtype=np.int64)))

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """The verifier's or the reward function's score of one completion."""
        return self.rewards([prompt], [completion])[0]

    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        """A batch of scores: the verifier's in one call (it may raise: a data failure), else the function's."""
        if len(prompts) != len(completions):
            raise ValueError(f"rewards: {len(prompts)} prompts but {len(completions)} completions.")
        if self.verifier is not None:
            return [float(r) for r in self.verifier.rewards(prompts, completions)]
        if self._funcs is not None:
            funcs, ids = self._funcs
            return [float(t) for t in funcs.score(prompts, completions, ids(completions)).totals]
        assert self._fn is not None
        return [float(self._fn(p, c)) for p, c in zip(prompts, completions, strict=True)]

    def scored(self, prompts: Sequence[PromptRecord], completions: Sequence[str],
               completion_ids: Sequence[Sequence[int]]) -> list[Scored]:
        """With ``reward_funcs``: each function's value beside the weighted total (``train/rewards/<name>``)."""
        if self._funcs is None:
            return super().scored(prompts, completions, completion_ids)
        return list(self._funcs[0].scored(prompts, completions, completion_ids))

    def images(self, prompt: PromptRecord) -> list[Any]:
        """With ``image_column``: the prompt's row's images (PIL ``RGB``), read from the dataset where they are used."""
        if self.image_column is None:
            return []
        ref = prompt.metadata.get(ROW_REF)
        if not isinstance(ref, Mapping):
            raise KeyError(f"prompt {prompt.prompt_id} carries no {ROW_REF!r}: it was not read by this DatasetTask")
        table = self._split(str(ref["split"])).table
        value = column(table.slice(int(ref["index"]), 1), (self.image_column,)).to_pylist()[0]
        return decode_images(value, image_base_dir(self._source))

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        """The verifier's mask (e.g. ``MathVerify(mask_unparsable=true)``); never with a reward function."""
        return self.verifier.masked(prompt, completion) if self.verifier is not None else False

    def __getstate__(self) -> dict[str, Any]:
        """Without the rows: the selection travels as bits, the dataset is opened again where it is read."""
        state = dict(self.__dict__)
        state.update(_splits={}, _rows={}, _tokenizer=None)
        state["_roles"] = {role: (name, np.packbits(mask), len(mask)) for role, (name, mask) in self._roles.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        roles = state.pop("_roles")
        self.__dict__.update(state)
        self._roles = {role: (name, np.unpackbits(bits, count=n).astype(bool)) for role, (name, bits, n) in roles.items()}
