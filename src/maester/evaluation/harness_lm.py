"""A maester model and tokenizer as an lm-evaluation-harness `LM`: no Hugging Face export in between.

The requests are scored as lm-eval's own `HFLM` scores them (`lm_eval/models/huggingface.py`), so a job and its
`convert to-hf` export agree: contexts and continuations are split by `TemplateLM`; a (context, continuation) pair
is left-truncated to the model's context plus one token; `loglikelihood_rolling` takes lm-eval's disjoint rolling
windows; `generate_until` left-truncates its context to leave room for `max_gen_toks`, decodes with the KV cache
(`maester.models.sampling`) until a stop string appears in the text, and cuts the text at the first one.

Requests are sorted longest first and run `batch_size` at a time (right-padded for scoring, left-padded for
generation). Data parallel happens inside each call, not in lm-eval's evaluator: every process builds every
request, takes its share of them (`Ranks`), and the results are gathered to all, so lm-eval sees one process and
computes the same metrics everywhere (rank 0 reports them). A model sharded over the processes (FSDP, TP) must run
its forwards in step: with `Ranks.in_step`, every process runs as many batches, and decodes as many tokens, as the
busiest one (the others repeat a batch and throw its results away). Since every process makes the same calls in
the same order, a task with fewer documents than processes cannot leave one of them out of a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn
from tqdm import tqdm

from maester.data.tokenizers import Tokenizer
from maester.models.sampling import sample_batch
from maester.parallel.ranks import max_over_ranks

GENERATION_KEYS = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"})
"""The generation settings of a task that `generate_until` follows; any other is an error naming it."""


@dataclass(frozen=True)
class Ranks:
    """How the processes share the requests of a call: this one's `rank` of `size` (data parallel) and their
    process `group` (None: the default group), which gathers the results; whether every process of the default
    group must run its forwards in step (`in_step`: the weights are sharded over them)."""

    rank: int = 0
    size: int = 1
    group: object = None
    in_step: bool = False


class MaesterLM(TemplateLM):
    """`model` (whole, or sharded as training shards it) and `tokenizer` as an lm-eval LM. `add_bos`: every request
    starts with BOS, as the documents did in training (`data.add_bos`). `forward_context`: the context every
    forward runs in (autocast). `cache_dtype`: the dtype the model computes in, for the KV cache. `seq_multiple`:
    every forward takes a multiple of this many positions (sequence parallel). `max_length`: the context the
    requests are truncated to (default: the model's)."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, *, device: torch.device, add_bos: bool = False,
                 batch_size: int = 8, max_length: int | None = None, ranks: Ranks = Ranks(),
                 forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 cache_dtype: torch.dtype | None = None, seq_multiple: int = 1, progress: bool = True,
                 info: dict | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"the batch size must be at least 1, got {batch_size}")
        self.model, self.maester_tokenizer, self.add_bos = model, tokenizer, add_bos
        self._device, self.batch_size, self.ranks = device, batch_size, ranks
        self._max_length = max_length or model.args.max_seq_len
        self.forward_context, self.cache_dtype, self.seq_multiple = forward_context, cache_dtype, seq_multiple
        self.progress, self.info = progress, info or {}
        self._special = frozenset(tokenizer.special_tokens().values())

    # ---------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.maester_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.maester_tokenizer.bos_id
        return bos if bos is not None else self.maester_tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        bos = self.add_bos and add_special_tokens is not False and self.maester_tokenizer.bos_id is not None
        return ([self.maester_tokenizer.bos_id] if bos else []) + self.maester_tokenizer.encode(string)

    def tok_decode(self, ids: list[int]) -> str:
        """The text of `ids` without special tokens (HF's `skip_special_tokens=True`) or ids past the vocabulary
        (a model's padded embedding rows)."""
        vocab = self.maester_tokenizer.vocab_size
        return self.maester_tokenizer.decode([i for i in ids if i < vocab and i not in self._special])

    # ---------------------------------------------------------------- scoring

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self._shows_progress())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) of each
        (strings, context ids, continuation ids); a request too long is cut from the left, as HFLM does."""
        rows = []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens: it must have 1 to "
                                 f"{self.max_length} (the model's context)")
            rows.append(((context + continuation)[-(self.max_length + 1):][:-1], continuation))
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), tuple(rows[i][0])))
        mine = order[self.ranks.rank::self.ranks.size]
        batches = [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
        idle = [rows[order[0]]] if rows else [([self.prefix_token_id], [self.prefix_token_id])]
        scores: dict[int, tuple[float, bool]] = {}
        bar = tqdm(total=len(mine), desc="loglikelihood", disable=disable_tqdm or not self._shows_progress())
        for batch in self._in_step(batches):
            got = self._score([rows[i] for i in batch] if batch is not None else idle)
            scores.update(zip(batch or [], got))
            bar.update(len(batch or []))
        bar.close()
        results = [score for _, score in sorted(self._gathered(scores).items())]
        for (strings, _, _), score in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, score)
        return results

    @torch.no_grad()
    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One right-padded forward over the rows' inputs; each row's continuation scored at its last positions."""
        length = max(len(inp) for inp, _ in rows)
        length = -(-length // self.seq_multiple) * self.seq_multiple
        ids = torch.tensor([inp + [0] * (length - len(inp)) for inp, _ in rows], device=self._device)
        with self.forward_context():
            logits = self.model(ids)
        if hasattr(logits, "full_tensor"):  # vocabulary-sharded (tensor parallel)
            logits = logits.full_tensor()
        out = []
        for row, (inp, continuation) in enumerate(rows):
            picked = F.log_softmax(logits[row, len(inp) - len(continuation):len(inp)].float(), dim=-1)
            target = torch.tensor(continuation, device=picked.device)
            greedy = bool((picked.argmax(-1) == target).all())
            out.append((float(picked.gather(1, target[:, None]).sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole string, over lm-eval's disjoint windows of the model's context, the
        first conditioned on the prefix token (BOS, else EOS)."""
        windows, owners = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, where a task asks for it, sampled) continuations, each cut before the first of its stop
        strings; requests with the same settings are decoded together, longest first."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        texts: dict[int, str] = {}
        bar = tqdm(total=-(-len(requests) // self.ranks.size), desc="generate_until",
                   disable=disable_tqdm or not self._shows_progress())
        for members in groups.values():
            contexts = [requests[i].args[0] for i in members]
            for k, text in self._generate(contexts, requests[members[0]].args[1]):
                texts[members[k]] = text
                bar.update(1)
        bar.close()
        results = [text for _, text in sorted(self._gathered(texts).items())]
        for req, text in zip(requests, results):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results

    def _generate(self, contexts: list[str], gen_kwargs: dict):
        """(index into `contexts`, text) of this process's share of `contexts`, which share `gen_kwargs`."""
        unknown = sorted(set(gen_kwargs) - GENERATION_KEYS - {"max_new_tokens", "max_tokens",
                                                               "max_completion_tokens"})
        if unknown:
            raise ValueError(f"generation settings {', '.join(unknown)} of the task are not supported (maester "
                             f"follows {', '.join(sorted(GENERATION_KEYS))})")
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.maester_tokenizer.decode([self.eot_token_id]))
        max_gen_toks = kwargs.pop("max_gen_toks")
        if max_gen_toks >= self.max_length:
            raise ValueError(f"max_gen_toks = {max_gen_toks} leaves no room for a context in the model's "
                             f"{self.max_length} positions")
        sampling = dict(temperature=kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0,
                        top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"))
        encoded = [self.tok_encode(c)[-(self.max_length - max_gen_toks):] for c in contexts]
        order = sorted(range(len(contexts)), key=lambda i: (-len(encoded[i]), contexts[i]))
        mine = order[self.ranks.rank::self.ranks.size]
        batches = [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
        idle = [encoded[order[0]]]
        stops = [s for s in until if s]

        def stopped(row: int, ids: list[int]) -> bool:
            return any(s in self.tok_decode(ids) for s in stops)

        for batch in self._in_step(batches):
            with self.forward_context():
                outs = sample_batch(self.model, [encoded[i] for i in batch] if batch is not None else idle,
                                    max_gen_toks, eos_id=self.eot_token_id, stop_when=stopped, device=self._device,
                                    cache_dtype=self.cache_dtype, most=max_over_ranks if self.ranks.in_step else None,
                                    seq_multiple=self.seq_multiple, **sampling)
            for i, out in zip(batch or [], outs):
                yield i, postprocess_generated_text(self.tok_decode(out), until, None)

    # ---------------------------------------------------------------- processes

    def _in_step(self, batches: list[list[int]]):
        """The batches, and with `Ranks.in_step` as many empty ones (None) as the busiest process has more. Their
        number is agreed before the first batch: agreed later, one process's count would meet another's
        collectives inside a batch."""
        total = max_over_ranks(len(batches)) if self.ranks.in_step else len(batches)
        yield from batches
        yield from [None] * (total - len(batches))

    def _gathered(self, mine: dict) -> dict:
        """Every process's results of a call, from each one's share (`mine`: index -> result)."""
        if self.ranks.size == 1:
            return mine
        parts = [None] * self.ranks.size
        dist.all_gather_object(parts, mine, group=self.ranks.group)
        return {i: result for part in parts for i, result in part.items()}

    def _shows_progress(self) -> bool:
        return self.progress and (not dist.is_initialized() or dist.get_rank() == 0)

    def get_model_info(self) -> dict:
        """What simple_evaluate records of the model in the results' `config`."""
        return dict(self.info)
