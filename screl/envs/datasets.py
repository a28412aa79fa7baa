"""Prompts from a dataset read through Hugging Face ``datasets``: a local file or folder, or a hub dataset.

:class:`DatasetTask` reads one split (and optionally a second one for validation), builds one
:class:`~screl.envs.PromptRecord` per row, and scores completions with a :class:`~screl.envs.Verifier`
(:class:`~screl.envs.MathVerify`) or a user function. Its configuration is its identity: ``path``, ``split``,
``data_files``, ``revision`` and the filters are init arguments, so they are part of the run configuration and
of the bootstrap fingerprint; a restart over a different dataset refuses the bootstrap restore and names the
changed key (``data.init_args.task.init_args.path: "old" -> "new"``).

``datasets`` comes with the ``tasks`` extra (``pip install 'screl[tasks]'``).
"""

from __future__ import annotations

import json
import logging
import os
import string
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from screl.envs.base import PromptRecord, Task, Verifier, load_reward_fn
from screl.envs.dataset_images import ROW_REF, check_images, decode_images, image_base_dir, undecoded
from screl.envs.tasks import json_object, split_holdout, text_lines

if TYPE_CHECKING:
    from screl.models.spec import PolicySpec

log = logging.getLogger(__name__)

KEY = "data.init_args.task.init_args"
"""Where a DatasetTask's arguments sit in a run config (error messages name ``KEY.<argument>``)."""
FILTER_REPORT = "dataset_filter.json"
"""The file ``max_prompt_tokens`` writes under the run directory (kept and dropped counts per split)."""
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
_MAX_LISTED_IDS = 100


def _load(path: str, split: str, data_files: Any, revision: str | None, name: str | None) -> Any:
    """One split as a ``datasets.Dataset``: a local file (format by suffix), a local folder (``datasets``
    infers the format) or a hub dataset."""
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - the dev extra installs it
        raise ImportError("DatasetTask needs Hugging Face `datasets`: pip install 'screl[tasks]'") from err
    kwargs: dict[str, Any] = {"split": split, "revision": revision}
    if os.path.isfile(path):
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in _FORMATS:
            raise ValueError(f"{KEY}.path={path!r}: unknown file format {suffix!r}; use one of {sorted(_FORMATS)}"
                             " (or a folder, or data_files with the builder name as path)")
        if split != "train" and data_files is None:
            raise ValueError(f"{KEY}.split={split!r}: a single file has only the 'train' split; set split: train,"
                             " or give data_files: {split: file, ...}")
        if data_files is None:
            _check_text_file(path, _FORMATS[suffix])
        try:
            return datasets.load_dataset(_FORMATS[suffix], data_files=data_files or {"train": path}, **kwargs)
        except datasets.exceptions.DatasetGenerationError as err:  # its message is only "An error occurred..."
            cause = err.__cause__ or err.__context__ or err
            raise ValueError(f"{KEY}.path={path!r} cannot be read as {_FORMATS[suffix]}: {type(cause).__name__}:"
                             f" {cause}") from err
    if not os.path.exists(path) and (path.startswith((".", "/")) or os.path.splitext(path)[1] in _FORMATS):
        raise FileNotFoundError(f"{KEY}.path={path!r} does not exist (a local file or folder, or a hub name)")
    try:
        return datasets.load_dataset(path, name, data_files=data_files, **kwargs)
    except ValueError as err:  # an unknown split: name the key
        raise ValueError(f"{KEY}.split={split!r} cannot be read from {path!r}: {err}") from err


def _check_text_file(path: str, fmt: str) -> None:
    """A local JSON Lines or CSV file, line by line, before ``datasets`` parses it (its errors name neither the file
    nor the row): empty, bytes that are not UTF-8, a JSON line that does not parse. ValueError names the line."""
    if fmt not in ("json", "csv") or path.lower().endswith(".json"):
        if os.path.getsize(path) == 0:
            raise ValueError(f"{KEY}.path={path!r} is empty (0 bytes): no prompts to train on")
        return
    rows = 0
    for number, line in text_lines(path, lambda n: f"{KEY}.path={path!r}: line {n}"):
        rows += 1
        if fmt == "json":
            json_object(line, f"{KEY}.path={path!r}: line {number} (row {rows - 1})")
    if rows == 0 or (fmt == "csv" and rows == 1):
        raise ValueError(f"{KEY}.path={path!r} has no rows" + (" (only a header)" if rows else " (it is empty)")
                         + ": no prompts to train on")


def _context_positions(policy: PolicySpec) -> int | None:
    """The model's context (``max_position_embeddings``) when its spec tells it without loading the model."""
    try:
        config = policy.build_config()
    except Exception:  # noqa: BLE001 - a spec that cannot tell: no check here (the engine's own limit applies)
        return None
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _prompt_sources(prompt_column: str | None, messages_column: str | None, prompt_template: str | None,
                    system_prompt: str | None, chat_template: bool) -> list[str]:
    """The prompt-source arguments given (at most one), checked against ``chat_template``."""
    given = [k for k, v in (("prompt_column", prompt_column), ("messages_column", messages_column),
                            ("prompt_template", prompt_template)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{KEY}: {' and '.join(given)} are both set; give exactly one prompt source")
    if messages_column is not None and not chat_template:
        raise ValueError(f"{KEY}.messages_column={messages_column!r} needs {KEY}.chat_template: true"
                         " (a chat becomes text only through the tokenizer's chat template)")
    if system_prompt is not None and not chat_template:
        raise ValueError(f"{KEY}.system_prompt needs {KEY}.chat_template: true (or set the policy's own"
                         " system_prompt with its chat_template)")
    return given


def _check_scoring(verifier: Verifier | None, reward_fn: str | None, max_prompt_tokens: int | None, holdout: int,
                   val_split: str | None) -> None:
    """Exactly one scorer, a positive token limit, and one way of choosing the validation prompts."""
    if (verifier is None) == (reward_fn is None):
        raise ValueError(f"{KEY}: give exactly one of verifier (e.g. screl.envs.MathVerify) and reward_fn"
                         f" ('package.module:function'); got {'both' if verifier else 'neither'}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"{KEY}.max_prompt_tokens={max_prompt_tokens} must be >= 1, or null for no limit")
    if holdout and val_split is not None:
        raise ValueError(f"{KEY}: holdout={holdout} and val_split={val_split!r} both choose the validation"
                         " prompts; set one of them")


class DatasetTask(Task):
    """Prompts from a dataset, each row one prompt, scored by a verifier or a reward function.

    The prompt is the ``prompt_column`` text, or the ``messages_column`` chat (a list of ``{"role", "content"}``),
    or ``prompt_template`` filled from the row (``"{question}"``); exactly one of them (default: the ``prompt``
    column). Every other column goes to the prompt's ``metadata``, the reference answer also as
    ``metadata["answer"]`` (what :class:`~screl.envs.MathVerify` reads) and the task source as
    ``metadata["task_source"]`` (what ``rollout_recovery.task_source_granularity_overrides`` keys on).

    Prompt ids are the ``id_column`` integers, else the row index within the split (stable as long as the split
    is). With ``val_split`` the held-out prompts are that split's rows, numbered within it.

    Args:
        path: A local file (``.parquet``, ``.jsonl``, ``.json``, ``.csv``, ``.arrow``), a local folder, a
            ``datasets`` builder name (``parquet``, ``json``... with ``data_files``) or a hub dataset
            (``openai/gsm8k``; needs the hub reachable, pin ``revision``).
        split: The training split.
        data_files: Passed to ``datasets.load_dataset`` (a file, a list, or ``{split: files}``).
        revision: The hub revision (a commit hash pins the data; part of the run's identity).
        name: The hub dataset's configuration (``main`` for ``openai/gsm8k``).
        prompt_column: Column holding the prompt text.
        messages_column: Column holding a chat (needs ``chat_template``).
        prompt_template: ``str.format`` template over the row's columns.
        answer_column: Column holding the reference answer (``metadata["answer"]``); None: no answer.
        id_column: Column holding a unique integer id per row; None: the row index.
        task_source_column: Column naming each row's task source (``metadata["task_source"]``).
        image_column: Column holding each row's image(s) for a vision-language policy (a path relative to the
            dataset file's folder, encoded bytes, a Hugging Face ``Image`` feature, or a list of them): checked when
            the dataset is read, decoded on the rollout worker (:meth:`images`); the prompt record holds only its
            row (``metadata["dataset_row"]``), never the image.
        system_prompt: With ``chat_template``: a system turn before the prompt (unless its messages start with
            one).
        chat_template: Render each prompt with the policy tokenizer's chat template (user turn, then the
            assistant's turn opened) when the run starts; the policy then must not template again
            (``HFCausalLM.chat_template: false``). False: the text as is (or templated by the policy).
        max_prompt_tokens: Drop prompts longer than this many tokens under the policy's tokenizer (counted as the
            model sees them) when the run starts; the counts are logged and written to
            ``<run_dir>/dataset_filter.json``.
        holdout: Prompts of the training split kept back for validation (``val_prompts()``).
        val_split: A split whose rows are the validation prompts (instead of ``holdout``).
        verifier: Scores completions (:class:`~screl.envs.MathVerify`).
        reward_fn: Or a function ``"package.module:function"``, called as ``fn(prompt, completion) -> float``.
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
    ) -> None:
        given = _prompt_sources(prompt_column, messages_column, prompt_template, system_prompt, chat_template)
        _check_scoring(verifier, reward_fn, max_prompt_tokens, holdout, val_split)
        self.path, self.split, self.data_files, self.revision, self.name = path, split, data_files, revision, name
        self.prompt_column = prompt_column if given else "prompt"
        self.messages_column, self.prompt_template = messages_column, prompt_template
        self.answer_column, self.id_column, self.task_source_column = answer_column, id_column, task_source_column
        self.image_column = image_column
        self._splits: dict[str, Any] = {}  # split -> its dataset, read back for images on the worker (not pickled)
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.max_prompt_tokens, self.holdout, self.val_split = max_prompt_tokens, holdout, val_split
        self.verifier, self.reward_fn = verifier, reward_fn
        self._fn = load_reward_fn(reward_fn) if reward_fn is not None else None
        self._chats: dict[tuple[str, int], list[dict[str, str]]] = {}  # (split, id) -> the messages_column chat
        train = self._records(split, "split")
        if val_split is not None:
            self._train, self._held = train, self._records(val_split, "val_split")
        else:
            self._train, self._held = split_holdout(train, holdout) if holdout else (train, [])
        self._prepared_for: Any = None

    # -- reading ---------------------------------------------------------------------------------------
    def _records(self, split: str, key: str) -> list[PromptRecord]:
        ds = _load(self.path, split, self.data_files, self.revision, self.name)
        columns = set(ds.column_names)
        needed = {"prompt_column": self.prompt_column if not (self.messages_column or self.prompt_template)
                  else None, "messages_column": self.messages_column, "answer_column": self.answer_column,
                  "id_column": self.id_column, "task_source_column": self.task_source_column,
                  "image_column": self.image_column}
        for knob, column in needed.items():
            if column is not None and column not in columns:
                raise KeyError(f"{KEY}.{knob}={column!r} is not a column of {self.path!r} ({key}={split!r});"
                               f" its columns: {sorted(columns)}")
        if self.image_column is not None:
            ds = undecoded(ds, self.image_column)  # reading the rows decodes no image
        records: list[Any] = []
        seen: dict[Any, int] = {}
        for index, row in enumerate(ds):
            pid = self._id(row, index, split)
            if pid in seen:
                raise ValueError(f"{KEY}.id_column={self.id_column!r}: id {pid} appears twice in {self.path!r}"
                                 f" ({key}={split!r}): rows {seen[pid]} and {index}; ids must be unique")
            seen[pid] = index
            records.append(self._record(pid, row, split, index))
        if not records:
            raise ValueError(f"{KEY}.{key}={split!r} of {self.path!r} has no rows")
        return records

    def _id(self, row: Mapping[str, Any], index: int, split: str) -> int:
        if self.id_column is None:
            return index
        value = row[self.id_column]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{KEY}.id_column={self.id_column!r} holds {value!r} (row {index} of split {split!r}):"
                            " ids must be integers; use a column of ints, or null for the row index")
        return value

    def _record(self, pid: int, row: Mapping[str, Any], split: str, index: int = 0) -> PromptRecord:
        meta = dict(row)
        where = f"row {index} of {self.path!r} (split {split!r})"
        used = ([self.messages_column] if self.messages_column is not None else
                [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f]
                if self.prompt_template is not None else [str(self.prompt_column)])
        for column in used:
            name = column.split(".")[0].split("[")[0]
            value = row.get(name)
            if name not in row:
                continue  # a column the dataset lacks: named below (prompt_template) or above (the others)
            if value is None or (isinstance(value, str) and not value.strip() and column == self.prompt_column):
                knob = ("messages_column" if self.messages_column is not None else
                        "prompt_template" if self.prompt_template is not None else "prompt_column")
                raise ValueError(f"{where} has {'no' if value is None else 'an empty'} {column!r} (the prompt,"
                                 f" {KEY}.{knob}): every row needs one; fix or remove that row")
        if self.messages_column is not None:
            chat = [{"role": str(m["role"]), "content": str(m["content"])} for m in meta.pop(self.messages_column)]
            self._chats[(split, pid)] = chat
            text = next((m["content"] for m in reversed(chat) if m["role"] == "user"), chat[-1]["content"])
        elif self.prompt_template is not None:
            try:
                text = self.prompt_template.format(**row)
            except KeyError as err:
                raise KeyError(f"{KEY}.prompt_template names the column {err.args[0]!r}, which {self.path!r}"
                               f" does not have; its columns: {sorted(row)}") from err
        else:
            text = str(meta.pop(str(self.prompt_column)))
        if self.answer_column is not None:
            meta["answer"] = row[self.answer_column]
        if self.task_source_column is not None:
            meta["task_source"] = str(row[self.task_source_column])
        if self.image_column is not None:
            check_images(meta.pop(self.image_column, None), where, self.image_column, image_base_dir(self.path))
            meta[ROW_REF] = {"split": split, "index": index}
        return PromptRecord(prompt_id=pid, text=text, metadata=meta)

    # -- preparing for the run's policy -----------------------------------------------------------------
    def prepare(self, policy: PolicySpec, run_dir: str) -> None:
        """With ``chat_template``: render every prompt with the policy tokenizer's chat template. With
        ``max_prompt_tokens``: drop the prompts longer than that (as the policy tokenizes them), log the counts
        and write them to ``<run_dir>/dataset_filter.json``. Idempotent for one policy."""
        if self._prepared_for == policy:
            return
        limit = _context_positions(policy)
        if not (self.chat_template or self.max_prompt_tokens is not None or limit is not None):
            return
        if self.chat_template and getattr(policy, "chat_template", False):
            raise ValueError(f"{KEY}.chat_template and model.init_args.policy.init_args.chat_template are both"
                             " true: the prompt would be templated twice; set one of them to false")
        tokenizer = policy.build_tokenizer()
        val_split = self.val_split or self.split
        if self.chat_template:
            self._train = [self._render(tokenizer, r, self.split) for r in self._train]
            self._held = [self._render(tokenizer, r, val_split) for r in self._held]
        if self.max_prompt_tokens is not None:
            report: dict[str, Any] = {"path": self.path, "max_prompt_tokens": self.max_prompt_tokens}
            self._train, report["train"] = self._filter(policy, tokenizer, self._train, self.split)
            self._held, report["val"] = self._filter(policy, tokenizer, self._held, val_split)
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, FILTER_REPORT), "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        if limit is not None:
            for records, split in ((self._train, self.split), (self._held, val_split)):
                self._check_context(policy, tokenizer, records, split, limit)
        self.__dict__.pop("_by_id", None)
        self._prepared_for = policy

    def _render(self, tokenizer: Any, record: PromptRecord, split: str) -> PromptRecord:
        chat = self._chats.get((split, record.prompt_id)) or [{"role": "user", "content": record.text}]
        if self.system_prompt is not None and chat[0]["role"] != "system":
            chat = [{"role": "system", "content": self.system_prompt}, *chat]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return PromptRecord(record.prompt_id, str(text), record.metadata)

    def _check_context(self, policy: PolicySpec, tokenizer: Any, records: list[PromptRecord], split: str,
                       limit: int) -> None:
        """A prompt that fills the model's whole context leaves no room to generate: refused before the run
        starts, naming it (the id is the row index without ``id_column``)."""
        for r in records:
            n = len(policy.prompt_token_ids(tokenizer, r.text))
            if n >= limit:
                raise ValueError(f"{KEY}: prompt id {r.prompt_id} of {self.path!r} (split {split!r}) is {n} tokens"
                                 f" under the policy's tokenizer, and the model's context is {limit} positions"
                                 " (max_position_embeddings): nothing could be generated. Set"
                                 f" {KEY}.max_prompt_tokens to drop such prompts, or shorten it")

    def _filter(self, policy: PolicySpec, tokenizer: Any, records: list[PromptRecord],
                split: str) -> tuple[list[PromptRecord], dict[str, Any]]:
        limit = int(self.max_prompt_tokens or 0)
        kept = [r for r in records if len(policy.prompt_token_ids(tokenizer, r.text)) <= limit]
        dropped = sorted({r.prompt_id for r in records} - {r.prompt_id for r in kept})
        if records and not kept:
            which = "held-out prompt" if records is self._held else "prompt"
            raise ValueError(f"{KEY}.max_prompt_tokens={limit} drops every {which} of {self.path!r} (split"
                             f" {split!r}, {len(records)} prompts) under the policy's tokenizer; raise it")
        if dropped:
            log.warning("DatasetTask: max_prompt_tokens=%d dropped %d of %d prompts of %s (split %s)", limit,
                        len(dropped), len(records), self.path, split)
        return kept, {"split": split, "kept": len(kept), "dropped": len(dropped),
                      "dropped_ids": dropped[:_MAX_LISTED_IDS]}

    # -- the task ---------------------------------------------------------------------------------------
    def prompts(self) -> list[PromptRecord]:
        """The training prompts (less the held-out ones, and after ``prepare``, the ones too long)."""
        return list(self._train)

    def val_prompts(self) -> list[PromptRecord]:
        """The ``val_split`` rows, or the ``holdout`` prompts kept back from the training split."""
        return list(self._held)

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """The verifier's or the reward function's score of one completion."""
        return self.rewards([prompt], [completion])[0]

    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        """A batch of scores: the verifier's in one call (it may raise: a data failure), else the function's."""
        if len(prompts) != len(completions):
            raise ValueError(f"rewards: {len(prompts)} prompts but {len(completions)} completions.")
        if self.verifier is not None:
            return [float(r) for r in self.verifier.rewards(prompts, completions)]
        assert self._fn is not None
        return [float(self._fn(p, c)) for p, c in zip(prompts, completions, strict=True)]

    def images(self, prompt: PromptRecord) -> list[Any]:
        """With ``image_column``: the prompt's row's images (PIL ``RGB``), read from the dataset where they are used."""
        if self.image_column is None:
            return []
        ref = prompt.metadata.get(ROW_REF)
        if not isinstance(ref, Mapping):
            raise KeyError(f"prompt {prompt.prompt_id} carries no {ROW_REF!r}: it was not read by this DatasetTask")
        split = str(ref["split"])
        if split not in self._splits:
            self._splits[split] = undecoded(_load(self.path, split, self.data_files, self.revision, self.name),
                                            self.image_column)
        value = self._splits[split][int(ref["index"])][self.image_column]
        return decode_images(value, image_base_dir(self.path))

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        """The verifier's mask (e.g. ``MathVerify(mask_unparsable=true)``); never with a reward function."""
        return self.verifier.masked(prompt, completion) if self.verifier is not None else False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_by_id", None)
        state["_splits"] = {}  # the worker reads its own
        return state
