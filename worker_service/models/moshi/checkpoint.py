"""Moshi checkpoints: loaded through moshi's own ``CheckpointInfo``, and small ones written here.

A checkpoint is a Hugging Face repo id (fetched by moshi's loader into the usual cache, as a user
with a GPU and network expects: Moshiko, Moshika, PersonaPlex-class checkpoints of the same
layout) or a local directory in that layout: ``config.json`` (the LM's config, with the names of
the other files: ``moshi_name``, ``mimi_name``, ``tokenizer_name``, optionally
``mimi_config_name`` and ``lm_gen_config``), the LM and Mimi weights (safetensors) and the
sentencepiece text tokenizer. The config decides the sizes of both the LM and Mimi, so a small
checkpoint of the real layout runs on a laptop CPU: ``write_small_checkpoint`` makes one with
random weights and a tokenizer trained on the spot (``duplex moshi-checkpoint DIR``).

A random Mimi is deaf: its codebooks start at zero, so every input maps to the same codes. The
small checkpoint fills them from what its own encoder makes of a few seconds of noise, tones and
chirps (each level from the residual the previous ones leave), so input changes the codes the
LM hears, and so its output.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The moshi release this adapter is written against (its metadata pins an older torch and numpy;
#: it is installed with ``pip install --no-deps`` after its real needs: docs/operations.md).
MOSHI_VERSION = "0.2.13"

_LM_NAME = "model.safetensors"
_MIMI_NAME = "mimi.safetensors"
_MIMI_CONFIG_NAME = "mimi_config.json"
_TOKENIZER_NAME = "tokenizer.model"


def import_moshi() -> Any:
    """The ``moshi`` package, or a clear error saying how to install it."""
    try:
        import moshi.models.loaders as loaders
    except ImportError as exc:
        raise ValueError(
            f"the moshi model needs Kyutai's moshi package: pip install --no-deps moshi=={MOSHI_VERSION} "
            "(after the worker extra, which brings its real needs; see docs/operations.md)"
        ) from exc
    return loaders


#: ``--checkpoint random:moshi-7b``: the real Moshi 7B layout (moshi's own default configs) with
#: random weights made in memory, nothing read or fetched: what a GPU benchmark measures when no
#: weights are cached (``benchmarks/gpu.sh``). It speaks noise.
RANDOM_7B = "random:moshi-7b"


def checkpoint_info(source: str) -> Any:
    """moshi's ``CheckpointInfo`` for a local directory or a Hugging Face repo id (or
    ``RANDOM_7B``: no weights, the caller makes them; a small tokenizer stands in).

    Local files are passed as ``Path`` objects: ``CheckpointInfo`` treats any file name given as a
    string as a hub download."""
    loaders = import_moshi()
    if source == RANDOM_7B:
        import tempfile

        tokenizer = Path(tempfile.mkdtemp(prefix="moshi-random-")) / _TOKENIZER_NAME
        tokenizer.write_bytes(train_tokenizer(SmallSizes().text_vocab))
        return loaders.CheckpointInfo(Path(), None, tokenizer, lm_gen_config={})
    path = Path(source).expanduser()
    if not path.exists():
        if source.startswith((".", "/", "~")) or source.count("/") != 1:
            raise ValueError(f"checkpoint {source!r}: no such directory (and not a Hugging Face repo id)")
        return loaders.CheckpointInfo.from_hf_repo(source)  # downloads into the Hugging Face cache
    config_path = path / "config.json"
    if not path.is_dir() or not config_path.is_file():
        raise ValueError(f"checkpoint {source!r}: a directory with config.json is expected")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {source!r}: config.json is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"checkpoint {source!r}: config.json must hold an object")

    def local(key: str, default: str | None) -> Path | None:
        name = config.get(key, default)
        if name is None:
            return None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise ValueError(f"checkpoint {source!r}: {key} must name a file of the directory")
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint {source!r}: {key} names {name!r}, which is not there")
        return file

    return loaders.CheckpointInfo.from_hf_repo(
        str(path),
        moshi_weights=local("moshi_name", loaders.MOSHI_NAME),
        mimi_weights=local("mimi_name", loaders.MIMI_NAME),
        tokenizer=local("tokenizer_name", loaders.TEXT_TOKENIZER_NAME),
        config_path=config_path,
        mimi_config_path=local("mimi_config_name", None),
    )


# ---- small checkpoints of the real layout ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SmallSizes:
    """The sizes of a small checkpoint (the real Moshi 7B: LM dim 4096 x 32 layers, Mimi 64 SEANet
    filters, latent 512, 8 transformer layers, 32k text tokens)."""

    lm_dim: int = 64
    lm_layers: int = 2
    lm_heads: int = 4
    depformer_dim: int = 32
    depformer_layers: int = 1
    dep_q: int = 8
    """Audio codebooks the model speaks (and hears: ``n_q`` is twice this)."""
    mimi_filters: int = 8
    mimi_latent: int = 64
    mimi_layers: int = 1
    codebook_dim: int = 32
    card: int = 2048
    """Entries per audio codebook (the LM's audio vocabulary)."""
    text_vocab: int = 128
    """The sentencepiece tokenizer's vocabulary (the LM's text vocabulary)."""


#: What the small checkpoint's tokenizer is trained on (a few plain sentences; any text works).
_CORPUS = (
    "hello there how are you doing today",
    "i am fine thank you and you",
    "what would you like to talk about",
    "the weather is nice and the sun is out",
    "can you hear me well on this line",
    "yes i can hear you clearly",
    "let me think about that for a moment",
    "that sounds like a good idea to me",
    "please tell me more about your day",
    "we went to the park and had lunch",
    "the quick brown fox jumps over the lazy dog",
    "numbers one two three four five six seven eight nine ten",
    "good morning good evening good night",
    "sorry i did not catch that could you repeat",
    "speech models listen and speak at the same time",
)


def train_tokenizer(vocab_size: int) -> bytes:
    """A sentencepiece model of ``vocab_size`` pieces trained on ``_CORPUS``, with Moshi's special
    ids: 0 unknown, 1 and 2 begin and end, 3 padding (0 and 3 are the text stream's silence)."""
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 8),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        hard_vocab_limit=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return out.getvalue()


def small_configs(sizes: SmallSizes, text_card: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The LM's ``config.json`` (without file names) and Mimi's config, of ``sizes``."""
    loaders = import_moshi()
    seanet = dict(loaders._seanet_kwargs, dimension=sizes.mimi_latent, n_filters=sizes.mimi_filters)
    quantizer = dict(
        loaders._quantizer_kwargs,
        dimension=sizes.codebook_dim,
        n_q=2 * sizes.dep_q,
        bins=sizes.card,
        input_dimension=sizes.mimi_latent,
        output_dimension=sizes.mimi_latent,
    )
    transformer = dict(
        loaders._transformer_kwargs,
        d_model=sizes.mimi_latent,
        num_heads=4,
        num_layers=sizes.mimi_layers,
        dim_feedforward=2 * sizes.mimi_latent,
        input_dimension=sizes.mimi_latent,
        output_dimensions=[sizes.mimi_latent],
    )
    mimi = dict(loaders._mimi_config, seanet=seanet, quantizer=quantizer, transformer=transformer)
    n_q = 2 * sizes.dep_q
    lm = dict(
        loaders._lm_kwargs,
        dim=sizes.lm_dim,
        num_heads=sizes.lm_heads,
        num_layers=sizes.lm_layers,
        hidden_scale=2,
        text_card=text_card,
        n_q=n_q,
        dep_q=sizes.dep_q,
        card=sizes.card,
        context=750,
        depformer_dim=sizes.depformer_dim,
        depformer_dim_feedforward=2 * sizes.depformer_dim,
        depformer_num_heads=2,
        depformer_num_layers=sizes.depformer_layers,
        # Text first; each stream's audio codebooks after it, the first without delay (as Moshi's).
        delays=[0] + ([0] + [1] * (sizes.dep_q - 1)) * 2,
    )
    return lm, mimi


def write_small_checkpoint(directory: Path, *, seed: int = 0, sizes: SmallSizes | None = None) -> Path:
    """Write a random-weight checkpoint of the real layout, reduced to ``sizes``, to ``directory``
    (created; files in it are replaced); returns the directory. Deterministic for a ``seed``."""
    import torch
    from safetensors.torch import save_file

    loaders = import_moshi()
    sizes = sizes or SmallSizes()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(sizes.text_vocab)
    (directory / _TOKENIZER_NAME).write_bytes(tokenizer)
    import sentencepiece

    text_card = sentencepiece.SentencePieceProcessor(model_proto=tokenizer).get_piece_size()
    lm_config, mimi_config = small_configs(sizes, text_card)
    torch.manual_seed(seed)
    with torch.no_grad():
        mimi = loaders.get_mimi(None, mimi_config, device="cpu", num_codebooks=sizes.dep_q)
        _fill_codebooks(mimi, seed)
        lm = loaders.get_moshi_lm(None, lm_kwargs=lm_config, device="cpu", dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(directory / _MIMI_NAME))
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(directory / _LM_NAME))
    (directory / _MIMI_CONFIG_NAME).write_text(json.dumps(mimi_config, indent=1))
    config = dict(
        lm_config,
        moshi_name=_LM_NAME,
        mimi_name=_MIMI_NAME,
        mimi_config_name=_MIMI_CONFIG_NAME,
        tokenizer_name=_TOKENIZER_NAME,
        model_type="moshi",
        lm_gen_config={"temp": 0.8, "temp_text": 0.7, "top_k": 250, "top_k_text": 25},
    )
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def _fill_codebooks(mimi: Any, seed: int) -> None:
    """Codebooks from the encoder's own latents of noise, tones and chirps, level by level (each
    from the residual the levels before leave), so different input gives different codes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rate = mimi.sample_rate
    t = torch.arange(2 * rate) / rate
    clips = [0.3 * torch.randn(2 * rate, generator=gen)]
    for f in (110.0, 220.0, 440.0, 880.0, 1760.0):
        clips.append(0.5 * torch.sin(2 * torch.pi * f * t))
    clips.append(0.5 * torch.sin(2 * torch.pi * (100.0 + 900.0 * t) * t))
    clips.append(torch.zeros(2 * rate))
    x = torch.stack(clips)[:, None, :]
    latent = mimi._encode_to_unquantized_latent(x)  # [B, C, T]
    quantizer = mimi.quantizer
    for rvq in (quantizer.rvq_first, quantizer.rvq_rest):
        residual = rvq.input_proj(latent).transpose(1, 2).reshape(-1, rvq.dimension)
        for layer in rvq.vq.layers:
            book = layer._codebook
            pick = torch.randint(len(residual), (book.codebook_size,), generator=gen)
            scale = residual.std().clamp(min=1e-3)
            vectors = residual[pick] + 0.05 * scale * torch.randn(book.codebook_size, book.dim, generator=gen)
            book.embedding_sum.copy_(vectors)
            book.cluster_usage.fill_(1.0)
            book._initialized.fill_(1.0)
            book._embedding = None
            nearest = torch.cdist(residual, vectors).argmin(dim=1)
            residual = residual - vectors[nearest]


def main(argv: list[str]) -> int:
    """``duplex moshi-checkpoint DIR``: write a small random-weight checkpoint to try the moshi
    model on a laptop (``duplex up --model moshi --checkpoint DIR``)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="duplex moshi-checkpoint",
        description="Write a small random-weight Moshi checkpoint of the real layout (it speaks noise "
        "and made-up words: it is for trying the serving path, not for listening).",
    )
    p.add_argument("directory", type=Path, help="where to write it (created)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--lm-dim", type=int, default=SmallSizes().lm_dim, help="LM width (default: %(default)s)")
    p.add_argument(
        "--lm-layers", type=int, default=SmallSizes().lm_layers, help="LM layers (default: %(default)s)"
    )
    args = p.parse_args(argv)
    try:
        sizes = SmallSizes(lm_dim=args.lm_dim, lm_layers=args.lm_layers)
        out = write_small_checkpoint(args.directory, seed=args.seed, sizes=sizes)
    except (OSError, ValueError) as exc:
        print(f"duplex moshi-checkpoint: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a small Moshi checkpoint to {out}; try: duplex up --model moshi --checkpoint {out}")
    return 0
