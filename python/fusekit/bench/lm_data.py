"""The language-model benchmark's data: the Python standard library's own source files (on every
machine that runs Python, offline), a byte-level BPE tokenizer trained on them, and the token
stream cut into [batch, context] sequences in one seeded order.

- Corpus: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (installed packages under
  ``site-packages``/``dist-packages`` left out), sorted by relative path; ``limit`` keeps the first
  N files, or the first files up to N bytes ("300", "2MB"). Validation: every 50th file of that
  list (index 0, 50, 100, ...); training: the others.
- Tokenizer: byte-level BPE (``tokenizers``), ``vocab`` entries including ``<|endoftext|>``,
  trained on the training files only, in their order.
- Stream: each file's tokens followed by ``<|endoftext|>``, files in order; training sequences are
  consecutive ``context``-token slices of it, visited in a permutation drawn from ``seed`` (a new
  one each pass); validation sequences in stream order.

Everything (tokenizer and token streams) is cached under ``cache`` keyed by the corpus' content,
the vocabulary size and the limit, so a second run on the same machine trains nothing.
"""
from __future__ import annotations

import hashlib
import os
import re
import sysconfig
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"
VAL_EVERY = 50


def parse_limit(limit: str | None) -> tuple[str, int] | None:
    """'300' -> ('files', 300); '2MB', '500kB', '1000B' -> ('bytes', n); None or '' -> None."""
    if not limit:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(B|kB|KB|MB|GB)?\s*", limit)
    if not m:
        raise ValueError(f"--corpus-limit: expected a file count (300) or a size (2MB, 500kB), got {limit!r}")
    n, unit = int(m.group(1)), m.group(2)
    if unit is None:
        return ("files", n)
    return ("bytes", n * {"B": 1, "kB": 1 << 10, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}[unit])


def corpus_files(limit: str | None = None) -> tuple[Path, list[Path]]:
    """(stdlib root, its .py files in sorted relative-path order, cut to `limit`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((f for f in root.rglob("*.py")
                    if f.is_file() and not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)),
                   key=lambda f: f.relative_to(root).as_posix())
    lim = parse_limit(limit)
    if lim and lim[0] == "files":
        files = files[:lim[1]]
    elif lim:
        kept, total = [], 0
        for f in files:
            total += f.stat().st_size
            if kept and total > lim[1]:
                break
            kept.append(f)
        files = kept
    if len(files) < 2:
        raise RuntimeError(f"the corpus under {root} has {len(files)} .py files (limit {limit!r}); need at least 2")
    return root, files


def read_text(f: Path) -> str:
    # A few test files are deliberately not UTF-8; replacing their bad bytes keeps the corpus
    # identical from run to run.
    return f.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    """The stream: each text's tokens then EOS, as int32."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


class Corpus:
    """Token streams of the training and validation files, and the tokenizer trained on them."""

    def __init__(self, cache: str, vocab: int = 32000, limit: str | None = None, log=print):
        root, files = corpus_files(limit)
        rel = [f.relative_to(root).as_posix() for f in files]
        texts = [read_text(f) for f in files]
        h = hashlib.sha256()
        for r, t in zip(rel, texts):
            h.update(r.encode())
            h.update(b"\0")
            h.update(t.encode())
            h.update(b"\0")
        self.sha = h.hexdigest()
        key = hashlib.sha256(f"{self.sha}/{vocab}/v1".encode()).hexdigest()[:16]
        val_idx = set(range(0, len(files), VAL_EVERY))
        train_texts = [t for i, t in enumerate(texts) if i not in val_idx]
        val_texts = [t for i, t in enumerate(texts) if i in val_idx]
        os.makedirs(cache, exist_ok=True)
        tok_path, tokens_path = os.path.join(cache, f"tokenizer-{key}.json"), os.path.join(cache, f"tokens-{key}.pt")
        from tokenizers import Tokenizer

        t0 = time.time()
        if os.path.exists(tok_path) and os.path.exists(tokens_path):
            self.tokenizer = Tokenizer.from_file(tok_path)
            streams = torch.load(tokens_path)
            self.train_tokens, self.val_tokens = streams["train"], streams["val"]
            self.cached = True
        else:
            log(f"lm: training a {vocab}-entry BPE tokenizer on {len(train_texts)} files "
                f"({sum(map(len, train_texts)) / 1e6:.1f}M characters) ...")
            self.tokenizer = train_tokenizer(train_texts, vocab)
            self.train_tokens, self.val_tokens = encode(self.tokenizer, train_texts), encode(self.tokenizer, val_texts)
            self.tokenizer.save(tok_path + ".tmp")
            torch.save({"train": self.train_tokens, "val": self.val_tokens}, tokens_path + ".tmp")
            os.replace(tok_path + ".tmp", tok_path)
            os.replace(tokens_path + ".tmp", tokens_path)
            self.cached = False
        self.seconds = time.time() - t0
        self.vocab = self.tokenizer.get_vocab_size()
        if self.vocab > vocab:
            raise RuntimeError(f"tokenizer has {self.vocab} entries, more than the model's {vocab}")
        self.info = {"corpus": "python stdlib *.py", "root": str(root), "sha256": self.sha, "limit": limit,
                     "files": len(files), "train_files": len(train_texts), "val_files": len(val_texts),
                     "val_split": f"every {VAL_EVERY}th file by sorted path",
                     "bytes": sum(len(t.encode()) for t in texts), "tokenizer": "byte-level BPE (tokenizers)",
                     "tokenizer_vocab": self.vocab, "train_tokens": int(self.train_tokens.numel()),
                     "val_tokens": int(self.val_tokens.numel()), "cache": os.path.abspath(cache),
                     "cache_hit": self.cached, "prepare_s": round(self.seconds, 2)}


class Batches:
    """[batch, context] int64 sequences from a token stream. shuffled: training order, consecutive
    `context`-slices visited in a seeded permutation (a fresh one each pass), so that batch k is
    the same in every run; else validation order (the slices in stream order)."""

    def __init__(self, tokens: torch.Tensor, context: int, seed: int = 0, shuffled: bool = True):
        self.context, self.seed, self.shuffled = context, seed, shuffled
        self.n = tokens.numel() // context
        if self.n < 1:
            raise RuntimeError(f"the token stream ({tokens.numel()} tokens) is shorter than one context ({context})")
        self.seqs = tokens[:self.n * context].view(self.n, context)
        self._perms: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffled:
            return torch.arange(self.n)
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        return self._perms[epoch]

    def indices(self, k: int, batch: int) -> list[int]:
        """The sequence indices of batch k (batches of this size laid end to end over the order)."""
        out = []
        for pos in range(k * batch, (k + 1) * batch):
            epoch, i = divmod(pos, self.n)
            out.append(int(self._order(epoch)[i]))
        return out

    def get(self, k: int, batch: int, device) -> torch.Tensor:
        x = self.seqs[self.indices(k, batch)].to(torch.int64)
        if torch.device(device).type == "cuda":  # pinned: the copy does not wait for the GPU to drain
            return x.pin_memory().to(device, non_blocking=True)
        return x
