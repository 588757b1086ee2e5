"""On-the-fly tokenizing loader for raw text (Parquet, JSONL): weighted sources, a seeded order, small state.

The global batch of G sequences is made of G *streams*; stream s always fills row s of every step. Stream s
reads, for each source, the chunks at positions s, s + G, s + 2G, ... of that source's endless chunk sequence
(epoch e is a seeded permutation of all the source's chunks, each chunk's rows in a seeded order), picks its
next document from the source furthest below its target token share, joins documents as [BOS] doc EOS and cuts
`seq_len + 1` windows with stride `seq_len`. A data-parallel rank serves the contiguous block of streams of its
rows, split over DataLoader workers; so neither the number of ranks nor of workers changes a single token, and
a stream's state is a handful of counters: the checkpoint holds all streams, and any rank count resumes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from maester.config import DataConfig, TokenizerConfig
from maester.data.batch import BatchPlan, make_batch
from maester.data.hub_datasets import pinned_commits, source_commits, source_identity
from maester.data.loader_base import LoaderBase
from maester.data.permutation import Permutation, mix64, seed_key
from maester.data.records import InvalidDocument
from maester.data.text_files import TextSource

log = logging.getLogger(__name__)


@dataclass
class StreamPlan:
    """What every stream needs, shared by all of them; picklable for worker processes."""

    data: DataConfig
    tokenizer: TokenizerConfig
    sources: list[TextSource]
    num_streams: int
    seed: int

    def holdout(self, p: int, chunk) -> np.ndarray:
        """Which rows of a chunk belong to source p's fixed validation split."""
        fraction = self.data.sources[p].validation_fraction
        rows = np.arange(chunk.start, chunk.start + chunk.rows, dtype=np.uint64)
        if fraction == 0:
            return np.zeros(chunk.rows, dtype=bool)
        h = mix64(rows ^ np.uint64(self.sources[p].file_key(chunk.file)))
        return h < np.uint64(int(fraction * 2.0 ** 64))

    def chunk_at(self, p: int, position: int):
        """Source p's chunk at a position of its endless sequence, and the order its training rows are read in."""
        n = len(self.sources[p].chunks)
        epoch, i = divmod(position, n)
        chunk = self.sources[p].chunks[Permutation(n, seed_key(self.seed, "source order", p, epoch))[i]]
        order = Permutation(chunk.rows, seed_key(self.seed, "chunk rows", p, position))[np.arange(chunk.rows)]
        return chunk, order[~self.holdout(p, chunk)[order]]

    def fingerprint(self) -> str:
        """Identifies files, chunking and split, so a resume on other data fails instead of drifting."""
        h = hashlib.sha256()
        for cfg, src in zip(self.data.sources, self.sources):
            h.update(json.dumps([source_identity(cfg.path), cfg.text_column, cfg.weight, cfg.validation_fraction,
                                 [f.name for f in src.files], src.num_rows, len(src.chunks)]
                                + pinned_commits(src.files)).encode())
        h.update(json.dumps([self.data.seq_len, self.data.add_bos, self.data.chunk_documents]).encode())
        return h.hexdigest()[:16]


class Stream:
    """One row of every step: documents from the weighted sources, joined and cut into windows."""

    def __init__(self, index: int, plan: StreamPlan, tokenizer, state: dict | None = None):
        self.index, self.plan, self.tokenizer = index, plan, tokenizer
        self.seq_len = plan.data.seq_len
        self.prefix = [tokenizer.bos_id] if plan.data.add_bos else []
        self.weights = np.array([s.weight for s in plan.data.sources], dtype=np.float64)
        n = len(plan.sources)
        state = state or {"windows": 0, "chunk": [0] * n, "row": [0] * n, "tokens": [0] * n,
                          "documents": [0] * n, "skipped": [0] * n, "last": None, "end": 0}
        self.state = json.loads(json.dumps(state))  # a private copy
        self._chunk_cache: dict[int, tuple[int, list]] = {}
        self.buffer = np.zeros(0, dtype=np.int64)
        last = self.state["last"]
        if last is not None:  # the document that holds the next window's first token
            doc = self._documents(last["source"], last["chunk"])[last["row"]]
            self.buffer = doc[self.state["windows"] * self.seq_len - last["start"]:]

    @property
    def position(self) -> int:
        return self.state["windows"] * self.seq_len

    def _documents(self, p: int, k: int) -> list:
        """Token arrays of the training rows of this stream's k-th chunk of source p (None where invalid)."""
        cached = self._chunk_cache.get(p)
        if cached is not None and cached[0] == k:
            return cached[1]
        source = self.plan.sources[p]
        chunk, order = self.plan.chunk_at(p, self.index + k * self.plan.num_streams)
        records = source.read(chunk)
        texts = [records[int(r)] for r in order]
        if not self.plan.data.skip_invalid:  # the first bad record in file order
            for r in sorted(order):
                if isinstance(records[r], InvalidDocument):
                    raise records[r]
        good = [t for t in texts if not isinstance(t, InvalidDocument)]
        encoded = iter(self.tokenizer.encode_batch(good) if good else [])
        eos = [self.tokenizer.eos_id]
        docs = [None if isinstance(t, InvalidDocument) else np.array(self.prefix + next(encoded) + eos, np.int64)
                for t in texts]
        self._chunk_cache[p] = (k, docs)
        return docs

    def _add_document(self) -> None:
        s = self.state
        p = int(np.argmin(np.array(s["tokens"]) / self.weights))
        n_chunks, empty_chunks = len(self.plan.sources[p].chunks), 0
        while True:
            docs = self._documents(p, s["chunk"][p])
            if s["row"][p] >= len(docs):
                s["chunk"][p], s["row"][p] = s["chunk"][p] + 1, 0
                empty_chunks += 1
                if empty_chunks > n_chunks:
                    raise ValueError(f"data source {self.plan.data.sources[p].path!r} has no training documents "
                                     f"(all held out for validation or invalid)")
                continue
            row = s["row"][p]
            s["row"][p] += 1
            if docs[row] is None:
                s["skipped"][p] += 1
                continue
            empty_chunks = 0
            doc = docs[row]
            break
        s["last"] = {"source": p, "chunk": s["chunk"][p], "row": row, "start": self.position + len(self.buffer)}
        s["tokens"][p] += len(doc)
        s["documents"][p] += 1
        s["end"] = s["last"]["start"] + len(doc)
        self.buffer = np.concatenate([self.buffer, doc])

    def next_window(self) -> np.ndarray:
        while len(self.buffer) < self.seq_len + 1:
            self._add_document()
        window = self.buffer[:self.seq_len + 1]
        self.buffer = self.buffer[self.seq_len:]
        self.state["windows"] += 1
        return window


class _StepRows(IterableDataset):
    """Yields, step after step, the windows of a block of streams: each worker serves its own block."""

    def __init__(self, plan: StreamPlan, streams: list[int], states: dict[int, dict | None], num_workers: int):
        self.plan, self.streams, self.states, self.num_workers = plan, streams, states, max(1, num_workers)

    def block(self, worker: int) -> list[int]:
        n, w = len(self.streams), self.num_workers
        return self.streams[worker * n // w:(worker + 1) * n // w]

    def __iter__(self):
        from maester.data.tokenizers import build_tokenizer

        info = get_worker_info()
        mine = self.block(info.id if info else 0)
        tokenizer = build_tokenizer(self.plan.tokenizer)
        streams = [Stream(i, self.plan, tokenizer, self.states.get(i)) for i in mine]
        while True:
            try:
                rows = np.stack([s.next_window() for s in streams])
            except (InvalidDocument, ValueError, OSError) as e:  # a bad record, a corrupt or vanished file
                if info is None:
                    raise
                # From a worker, as a value: the loader raises it as it is, not wrapped in DataLoader's report.
                yield {"error": e}
                return
            yield {"streams": mine, "rows": torch.from_numpy(rows), "states": [_snapshot(s.state) for s in streams]}


def _snapshot(state: dict) -> dict:
    return {k: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v for k, v in state.items()}


class TextLoader(LoaderBase):
    """Each optimizer step's micro-batches for one data-parallel rank, from raw text tokenized on the fly."""

    KIND, WHAT = "text", "a raw-text"

    def __init__(self, data: DataConfig, tokenizer_cfg: TokenizerConfig, tokenizer, *, seed: int, batch: BatchPlan,
                 group=None):
        super().__init__(batch, seed)
        if data.add_bos and tokenizer.bos_id is None:
            raise ValueError("data.add_bos is set but the tokenizer has no BOS token")
        self.data, self.tokenizer, self.group = data, tokenizer, group
        self.plan = StreamPlan(data, tokenizer_cfg, [TextSource(s, data.chunk_documents) for s in data.sources],
                               self.global_batch, seed)
        self.streams = list(self.my_rows)
        self.states: dict[int, dict | None] = {i: None for i in self.streams}
        self.num_workers = min(data.num_workers, len(self.streams))
        if self.num_workers < data.num_workers:
            log.info("data.num_workers=%d, but this rank serves %d streams: using %d workers",
                     data.num_workers, len(self.streams), self.num_workers)
        self._batches = None

    def _iterator(self):
        dataset = _StepRows(self.plan, self.streams, dict(self.states), self.num_workers)
        if self.num_workers == 0:
            return iter(dataset)
        # each worker tokenizes on one thread; Rust threads in a forked process would deadlock or warn
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Not pinned here: the rows are copied into the step's batches, which `Batch.to` pins on their way to
        # the GPU; pinning the workers' rows would be a copy thrown away.
        from maester.data.worker_pool import ignore_stop_signals

        return iter(DataLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=False,
                               persistent_workers=True, prefetch_factor=4, worker_init_fn=ignore_stop_signals))

    def next_step(self) -> list:
        if self._batches is None:
            self._batches = self._iterator()
        rows = torch.empty(len(self.streams), self.data.seq_len + 1, dtype=torch.int64)
        first = self.streams[0]
        for _ in range(max(1, self.num_workers)):  # one item per worker, in worker order
            item = next(self._batches)
            if "error" in item:
                raise item["error"]
            for stream, row, state in zip(item["streams"], item["rows"], item["states"]):
                rows[stream - first] = row
                self.states[stream] = state
        eos = self.tokenizer.eos_id
        return [make_batch(rows[i:i + self.micro_batch], self.data.document_masking, eos)
                for i in range(0, len(self.streams), self.micro_batch)]

    def close(self) -> None:
        self._batches = None  # the DataLoader's workers exit with their iterator

    def fingerprint(self) -> str:
        return self.plan.fingerprint()

    def source_commits(self) -> dict[str, str]:
        return source_commits(self.data.sources, [src.files for src in self.plan.sources])

    # --- state ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The state of every stream of every rank (collective over the data-parallel group)."""
        mine = {str(i): s for i, s in self.states.items()}
        if self.group is not None:
            import torch.distributed as dist

            gathered: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, mine, group=self.group)
            mine = {k: v for part in gathered for k, v in part.items()}
        return {**self.header(), "streams": self.global_batch, "states": mine}

    def load_state_dict(self, state: dict) -> None:
        self.check_resume(state)
        if state["streams"] != self.global_batch:
            raise ValueError(f"the checkpoint was written with a global batch of {state['streams']} sequences, "
                             f"now {self.global_batch}: the data streams would not line up")
        missing = [i for i in self.streams if str(i) not in state["states"]]
        if missing:
            raise ValueError(f"the checkpoint's data position lacks stream(s) {missing[:5]}: it was not gathered "
                             f"from every data-parallel rank")
        self.states = {i: state["states"][str(i)] for i in self.streams}
        self.close()

    # --- metrics -------------------------------------------------------------------------------------------------

    def source_metrics(self) -> dict[str, dict]:
        """Tokens trained on (inputs of the windows taken), documents started, skipped records and epochs per
        source over the whole run (collective)."""
        counts = np.zeros((len(self.plan.sources), 3), dtype=np.int64)
        for state in self.states.values():
            if state is not None:
                counts += np.array([state["tokens"], state["documents"], state["skipped"]]).T
                # the rest of the last document is tokenized but not yet trained on
                counts[state["last"]["source"], 0] -= state["end"] - state["windows"] * self.data.seq_len
        if self.group is not None:
            import torch.distributed as dist

            parts: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(parts, counts, group=self.group)
            counts = sum(parts)
        out = {}
        for (tokens, documents, skipped), cfg, src in zip(counts, self.data.sources, self.plan.sources):
            train_docs = src.num_rows * (1 - cfg.validation_fraction)  # the hash split holds out about this share
            out[cfg.display_name()] = {"tokens": int(tokens), "documents": int(documents), "skipped": int(skipped),
                                       "epochs": documents / max(train_docs, 1)}
        return out

    # --- validation ----------------------------------------------------------------------------------------------

    def validation_batches(self, micro_batch: int) -> list:
        """This rank's share of every held-out document, joined and cut into windows like training."""
        pieces, prefix, eos = [], [self.tokenizer.bos_id] if self.data.add_bos else [], [self.tokenizer.eos_id]
        for p, (cfg, src) in enumerate(zip(self.data.sources, self.plan.sources)):
            if cfg.validation_fraction == 0:
                continue
            for chunk in src.chunks:
                held = self.plan.holdout(p, chunk)
                texts = [r for r, h in zip(src.read(chunk), held) if h]
                bad = [t for t in texts if isinstance(t, InvalidDocument)]
                if bad and not self.data.skip_invalid:
                    raise bad[0]
                texts = [t for t in texts if not isinstance(t, InvalidDocument)]
                if texts:
                    pieces += [np.array(prefix + ids + eos, np.int64) for ids in self.tokenizer.encode_batch(texts)]
        seq = self.data.seq_len
        stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        n = max(0, (len(stream) - 1) // seq) // self.dp_size  # windows per rank, the same on every rank
        first = self.dp_rank * n
        rows = torch.from_numpy(stream[(first + np.arange(n))[:, None] * seq + np.arange(seq + 1)])
        return [make_batch(rows[i:i + micro_batch], self.data.document_masking, self.tokenizer.eos_id)
                for i in range(0, n, micro_batch)]
