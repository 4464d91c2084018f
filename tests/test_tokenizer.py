"""Tests of the tokenizers: ids compared with the library owning each format (tiktoken, sentencepiece, tokenizers)."""

import base64
import importlib.util
import json
import random
import unicodedata
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from titan_lite.data.tokenizer import (
    HFByteFallbackBPETokenizer,
    HFByteLevelBPETokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
    byte_level_alphabet,
    compile_pattern,
    describe_tokenizer,
)
from titan_lite.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "assets" / "tokenizer" / "tokenizer.model"

# Written out here, independently of the module, from Llama 3's published tokenizer.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(4)]
                   + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)])

TEXT = ("Hello, World! It's 2024; we'll pay $1,234.56 for 12345 apples, DON'T you think?\n\n"
        "  Indented line\twith a tab\r\nCAFÉ café — naïve 日本語 😀 <|end_of_text|> then <sep> and <|begin_of_text|>!\n"
        "Trailing   spaces   \n")

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's 9:45 and we'll meet at 10:30, won't we?
Numbers like 1, 22, 333, 4444 and 55555 appear; prices are $3.50, $12.99 and €7,00.
She sells sea shells by the sea shore; the shells she sells are surely sea shells.
Café au lait, naïve résumé, façade — déjà vu! 日本語のテキストと中文文本。 Ελληνικά και русский текст.
    Indented code: def add(a, b): return a + b  # comment
Tabs\tand\tnewlines\r\nmix with CAPITALS and MiXeD case. I'M SURE YOU'RE RIGHT, THEY'VE SAID.
"""


def corpus_lines() -> list[str]:
    """A few hundred deterministic lines: the corpus plus shuffled word salads of it."""
    words = CORPUS.split(" ")
    rng = random.Random(0)
    salads = [" ".join(rng.sample(words, 12)) for _ in range(200)]
    return CORPUS.splitlines(keepends=True) * 20 + salads


def single_line(message: str) -> bool:
    return "\n" not in message.strip()


# ---------------------------------------------------------------- Llama 3 tiktoken format


@pytest.fixture(scope="module")
def bundled() -> TiktokenTokenizer:
    tok = build_tokenizer(str(BUNDLED.parent))
    assert isinstance(tok, TiktokenTokenizer)
    return tok


@pytest.fixture(scope="module")
def reference_encoding():
    """tiktoken.Encoding built straight from the file with tiktoken's own loader and the Llama 3 pattern."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(BUNDLED))
    specials = {tok: len(ranks) + i for i, tok in enumerate(LLAMA3_SPECIALS)}
    return tiktoken.Encoding("reference", pat_str=LLAMA3_REGEX, mergeable_ranks=ranks, special_tokens=specials)


def test_bundled_tokenizer_covers_the_debug_vocab(bundled: TiktokenTokenizer):
    base = len(BUNDLED.read_text().splitlines())
    assert base == 1792
    assert (bundled.vocab_size, bundled.bos_id, bundled.eos_id, bundled.pad_id) == (2048, 1792, 1793, -1)
    assert bundled.special_tokens["<|eot_id|>"] == 1792 + 9
    assert bundled.special_tokens["<|reserved_special_token_250|>"] == 2047


def test_tiktoken_ids_match_tiktoken_encoding(bundled, reference_encoding):
    plain = reference_encoding.encode_ordinary(TEXT)
    assert bundled.encode(TEXT, bos=False) == plain
    assert bundled.encode(TEXT) == [1792] + plain
    assert bundled.encode(TEXT, bos=False, eos=True) == plain + [1793]
    with_specials = reference_encoding.encode(TEXT, allowed_special="all")
    assert bundled.encode(TEXT, bos=False, allow_special=True) == with_specials
    assert 1793 in with_specials and 1793 not in plain


def test_tiktoken_ids_match_transformers_conversion(bundled):
    pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import TikTokenConverter

    oracle = TikTokenConverter(vocab_file=str(BUNDLED), pattern=LLAMA3_REGEX,
                               extra_special_tokens=LLAMA3_SPECIALS).converted()
    assert oracle.get_vocab_size() == 2048
    assert bundled.encode(TEXT, bos=False, allow_special=True) == oracle.encode(TEXT, add_special_tokens=False).ids
    oracle.encode_special_tokens = True  # special-token strings become plain text
    assert bundled.encode(TEXT, bos=False) == oracle.encode(TEXT, add_special_tokens=False).ids


def test_tiktoken_round_trip(bundled):
    ids = bundled.encode(TEXT)
    assert bundled.decode(ids) == "<|begin_of_text|>" + TEXT
    assert bundled.decode(bundled.encode(TEXT, bos=False)) == TEXT
    assert len(ids) < len(TEXT.encode("utf-8")) * 0.7  # the merges compress, not just bytes


def test_tiktoken_specials_follow_the_file_size(tmp_path: Path):
    lines = BUNDLED.read_text().splitlines()[:300]
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    tok = build_tokenizer(str(tmp_path / "tokenizer.model"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (556, 300, 301)
    assert tok.encode("<|eot_id|>", bos=False, allow_special=True) == [309]


def test_python_regex_splits_like_the_regex_engine():
    regex = pytest.importorskip("regex")
    # \x1d is not White_Space for the regex engines though Python's str.isspace() says it is
    text = (TEXT + "x\x1d  y\u00a0z\u3000w ١٢٣٤ e\u0301te ǅemal ΣΊΣΥΦΟΣ ℕ² ⅫⅢ 'S 'Ll\r\n\r\n  \n x")
    assert compile_pattern(LLAMA3_REGEX).findall(text) == regex.findall(LLAMA3_REGEX, text)


# ---------------------------------------------------------------- the BPE trainer script


def load_trainer():
    spec = importlib.util.spec_from_file_location("train_bpe_tokenizer", REPO / "scripts" / "train_bpe_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def naive_bpe(counts: Counter, vocab_size: int) -> list[bytes]:
    """Reference trainer: recount every pair after every merge (ties to the lowest ids)."""
    tokens = [bytes([b]) for b in range(256)]
    words = {tuple(w): c for w, c in counts.items()}
    while len(tokens) < vocab_size:
        pairs = Counter()
        for word, count in words.items():
            for pair in pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], -p[0], -p[1]))
        joined = tokens[best[0]] + tokens[best[1]]
        if joined not in tokens:
            tokens.append(joined)
        new_id = tokens.index(joined)
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return tokens


def test_trainer_matches_naive_bpe(tmp_path: Path):
    trainer = load_trainer()
    (tmp_path / "a.txt").write_text(CORPUS * 10, encoding="utf-8")
    counts = trainer.count_pretokens([tmp_path / "a.txt"])
    assert counts[b" sea"] == 30 and counts[b"'s"] == 10 and counts[b"'VE"] == 10  # Llama 3 pieces
    assert trainer.train_bpe(counts, 400) == naive_bpe(counts, 400)


def test_trainer_writes_a_loadable_tiktoken_file(tmp_path: Path):
    trainer = load_trainer()
    (tmp_path / "a.txt").write_text(CORPUS, encoding="utf-8")
    out = tmp_path / "tok" / "tokenizer.model"
    trainer.main(["--input", str(tmp_path / "a.txt"), "--vocab-size", "300", "--output", str(out)])
    tok = build_tokenizer(str(out.parent))
    assert (tok.vocab_size, tok.bos_id) == (556, 300)
    rows = [line.split() for line in out.read_text().splitlines()]
    assert [int(rank) for _, rank in rows] == list(range(300))
    tokens = [base64.b64decode(b64) for b64, _ in rows]
    assert tokens[:256] == [bytes([b]) for b in range(256)]
    for rank in range(256, 300):  # each merge joins two earlier tokens
        assert any(tokens[rank][:k] in tokens[:rank] and tokens[rank][k:] in tokens[:rank]
                   for k in range(1, len(tokens[rank])))
    assert tok.decode(tok.encode(TEXT, bos=False)) == TEXT


# ---------------------------------------------------------------- sentencepiece


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("sp")
    (folder / "corpus.txt").write_text("".join(corpus_lines()), encoding="utf-8")
    spm.SentencePieceTrainer.train(  # Llama 2 style: BPE, byte fallback, no normalization, digits split
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "tokenizer"), vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
    return folder / "tokenizer.model"


def test_sentencepiece_ids_match_sentencepiece(sp_model: Path):
    import sentencepiece as spm

    oracle = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = build_tokenizer(str(sp_model.parent))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (400, 1, 2, 3)
    expected = oracle.encode(TEXT)
    assert tok.encode(TEXT) == [1] + expected
    assert tok.encode(TEXT, bos=False, eos=True) == expected + [2]
    assert tok.decode(tok.encode(TEXT)) == oracle.decode(expected) == TEXT
    marked = "a<s>b</s>"
    assert tok.encode(marked, bos=False, allow_special=True) == oracle.encode("a") + [1] + oracle.encode("b") + [2]
    assert tok.encode(marked, bos=False) == oracle.encode(marked)


def test_sentencepiece_ids_match_transformers(sp_model: Path, tmp_path: Path):
    pytest.importorskip("transformers")
    from transformers import LlamaTokenizer

    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    oracle = LlamaTokenizer.from_pretrained(str(tmp_path))
    tok = build_tokenizer(str(tmp_path))
    assert tok.encode(TEXT, bos=False) == oracle.encode(TEXT, add_special_tokens=False)
    assert (tok.bos_id, tok.eos_id) == (oracle.bos_token_id, oracle.eos_token_id)


# ---------------------------------------------------------------- HF tokenizer.json


def llama3_split_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def default_byte_level_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel()  # GPT-2 regex, add_prefix_space=True


def digits_byte_level_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])


def removed_spaces_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="removed"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {"llama3_split": llama3_split_pre_tokenizer, "byte_level": default_byte_level_pre_tokenizer,
                  "digits": digits_byte_level_pre_tokenizer, "removed_nfkc": removed_spaces_pre_tokenizer}


def train_hf_tokenizer(folder: Path, pre_tokenizer_name: str, bos_template: bool) -> Path:
    """Train a small byte-level BPE with `tokenizers`, save tokenizer.json and a tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=pre_tokenizer_name == "llama3_split"))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre_tokenizer_name]()
    if pre_tokenizer_name == "removed_nfkc":
        tok.normalizer = normalizers.NFKC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.add_tokens([AddedToken("<sep>", special=False, normalized=False)])
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("bos_template", [True, False])
@pytest.mark.parametrize("pre_tokenizer_name", sorted(PRE_TOKENIZERS))
def test_tokenizer_json_ids_match_tokenizers(tmp_path: Path, pre_tokenizer_name: str, bos_template: bool):
    tokenizers = pytest.importorskip("tokenizers")
    path = train_hf_tokenizer(tmp_path, pre_tokenizer_name, bos_template)
    oracle = tokenizers.Tokenizer.from_file(str(path))
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFByteLevelBPETokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (501, 0, 1, -1)
    assert tok.add_bos == bos_template
    assert tok.encode(TEXT, allow_special=True) == oracle.encode(TEXT).ids
    assert tok.encode(TEXT, bos=False, allow_special=True) == oracle.encode(TEXT, add_special_tokens=False).ids
    oracle.encode_special_tokens = True
    assert tok.encode(TEXT) == oracle.encode(TEXT).ids
    assert tok.encode(TEXT, bos=False, eos=True) == oracle.encode(TEXT, add_special_tokens=False).ids + [1]
    ids = tok.encode(TEXT + " ½ ﬁ", bos=False)  # NFKC changes these two
    assert ids == oracle.encode(TEXT + " ½ ﬁ", add_special_tokens=False).ids
    assert tok.decode(ids) == oracle.decode(ids, skip_special_tokens=False)
    assert 500 in ids and 1 not in ids  # <sep> (non-special) is always matched; specials stay text


def test_tokenizer_json_ids_match_transformers(tmp_path: Path):
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    path = train_hf_tokenizer(tmp_path, "llama3_split", bos_template=True)
    oracle = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<|begin_of_text|>",
                                     eos_token="<|end_of_text|>")
    tok = build_tokenizer(str(path))
    assert tok.encode(TEXT, allow_special=True) == oracle.encode(TEXT)
    assert tok.decode(tok.encode(TEXT)) == oracle.decode(oracle.encode(TEXT)) == "<|begin_of_text|>" + TEXT


def test_tokenizer_json_merges_follow_the_merge_list_not_token_ranks(tmp_path: Path):
    """With merges [b c, a b, ab c], "abc" stops at [a, bc]: rank-by-token BPE would give [abc]."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for extra in ("bc", "ab", "abc"):
        vocab[extra] = len(vocab)
    oracle = tokenizers.Tokenizer(models.BPE(vocab, [("b", "c"), ("a", "b"), ("ab", "c")]))
    oracle.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    oracle.decoder = decoders.ByteLevel()
    oracle.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.encode("abc xabcab", bos=False) == oracle.encode("abc xabcab").ids
    assert tok.encode("abc", bos=False) == [vocab["a"], vocab["bc"]]
    assert tok.backend == "python BPE"  # tiktoken's core would merge a + bc: not exact here


def test_tokenizer_json_from_converted_tiktoken_matches_bundled(bundled, tmp_path: Path):
    """Llama 3 style tokenizer.json (Split + ignore_merges + 256 specials + BOS template) from the bundled file."""
    pytest.importorskip("transformers")
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(vocab_file=str(BUNDLED), pattern=LLAMA3_REGEX,
                                  extra_special_tokens=LLAMA3_SPECIALS).converted()
    converted.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1792)])])
    converted.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    (tmp_path / "tokenizer.model").write_bytes(BUNDLED.read_bytes())
    tok = build_tokenizer(str(tmp_path))  # the folder prefers tokenizer.json
    assert isinstance(tok, HFByteLevelBPETokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (2048, 1792, 1793)
    assert tok.encode(TEXT, eos=True) == bundled.encode(TEXT, eos=True)
    assert tok.encode(TEXT, allow_special=True) == bundled.encode(TEXT, allow_special=True)


# ---------------------------------------------------------------- user errors


def test_missing_path_is_one_config_error_line(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="nope") as err:
        build_tokenizer(str(missing))
    assert single_line(str(err.value)) and "does not exist" in str(err.value)
    with pytest.raises(ConfigError, match="neither tokenizer.json nor tokenizer.model") as err:
        build_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"hello world\nnot a tokenizer\n", b""])
def test_garbage_model_file_is_one_config_error_line(tmp_path: Path, content: bytes):
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(ConfigError, match="neither a tiktoken file") as err:
        build_tokenizer(str(tmp_path))
    assert single_line(str(err.value)) and str(tmp_path / "tokenizer.model") in str(err.value)


def test_bad_tokenizer_json_is_one_config_error_line(tmp_path: Path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON file") as err:
        build_tokenizer(str(path))
    assert single_line(str(err.value)) and str(path) in str(err.value)
    path.write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}}))
    with pytest.raises(ConfigError, match="expected a BPE model") as err:
        build_tokenizer(str(path))
    assert single_line(str(err.value))
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                                "pre_tokenizer": {"type": "Whitespace"}}))
    with pytest.raises(ConfigError, match="not a byte-level BPE") as err:
        build_tokenizer(str(path))
    assert single_line(str(err.value)) and str(path) in str(err.value)


def test_folder_falls_back_to_tokenizer_model_when_json_is_not_byte_level(tmp_path: Path, bundled):
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "Whitespace"}}))
    (tmp_path / "tokenizer.model").write_bytes(BUNDLED.read_bytes())
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode(TEXT) == bundled.encode(TEXT)


# ---------------------------------------------------------------- Qwen and Mistral tokenizer.json

# Latin, accents, CJK, digits (Qwen splits them one by one), emoji (outside every test vocabulary: byte fallback),
# whitespace runs, tabs and CRLF; and the families' special tokens.
MIXED = ("Hello, World! It's 2024; naïve café — DON'T 日本語のテキストと中文文本。 😀🎉 ok\n\n   three   spaces\tand "
         "tabs 12345 + ０１２ Ελληνικά русский  \r\n  end ")
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen_tokenizer_json(folder: Path) -> Path:
    """A byte-level BPE trained with `tokenizers` in the structure of Qwen2.5's and Qwen3's tokenizer.json: NFC
    normalizer, Split with Qwen's regex then ByteLevel without its own regex, ByteLevel decoder and post-processor,
    <|endoftext|> / <|im_start|> / <|im_end|> special, no BOS (tokenizer_config.json: bos_token null)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.add_special_tokens(QWEN_SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "add_prefix_space": False}))
    return folder / "tokenizer.json"


def test_qwen_tokenizer_json_ids_match_tokenizers(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers")
    path = qwen_tokenizer_json(tmp_path)
    oracle = tokenizers.Tokenizer.from_file(str(path))
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFByteLevelBPETokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (-1, 500, 500, False)
    text = MIXED + "<|im_start|>user\nhi<|im_end|>" + "\u0065\u0301 decomposed"  # NFC composes e + acute accent
    assert tok.encode(text, allow_special=True) == oracle.encode(text).ids
    assert [501, 502] == [i for i in tok.encode(text, allow_special=True) if i > 500]
    oracle.encode_special_tokens = True
    ids = tok.encode(text, bos=True, eos=True)
    assert ids == oracle.encode(text).ids + [500]
    assert tok.decode(ids[:-1]) == oracle.decode(ids[:-1]) == unicodedata.normalize("NFC", text)


def test_added_tokens_match_leftmost_longest_as_tokenizers_does(tmp_path: Path):
    """Overlapping added tokens (one a prefix of another), a run of plain ones around one that strips spaces and one
    that matches only as a word, and hundreds of reserved tokens: the ids of `tokenizers` on text holding them all."""
    tokenizers = pytest.importorskip("tokenizers")
    path = qwen_tokenizer_json(tmp_path)
    oracle = tokenizers.Tokenizer.from_file(str(path))
    added = tokenizers.AddedToken
    oracle.add_special_tokens([added("<a>", special=True), added("<a><b>", special=True),
                               added("<|strip|>", special=True, lstrip=True, rstrip=True),
                               added("word", special=True, single_word=True),
                               *[f"<|reserved_{i}|>" for i in range(300)]])
    oracle.add_tokens(["<plain>", "<plain><more>"])
    oracle.save(str(path))
    tok = build_tokenizer(str(tmp_path))
    text = ("x<a><b>y <a>z<a><b><a> q  <|strip|>  r word swordy word. <|reserved_12|><|reserved_1|><|reserved_299|>"
            "<|reserved_3<plain><more><plain> <|im_start|>" + MIXED)
    assert tok.encode(text, bos=False, allow_special=True) == oracle.encode(text, add_special_tokens=False).ids
    oracle.encode_special_tokens = True
    assert tok.encode(text, bos=False) == oracle.encode(text, add_special_tokens=False).ids


def test_hundreds_of_reserved_tokens_cost_little_to_find(tmp_path: Path):
    """Chat rows are encoded with their special tokens (allow_special): with 300 reserved ones beside ChatML's, finding
    them must not cost more than encoding the text (an alternation tried token by token cost ~40x)."""
    import time

    tokenizers = pytest.importorskip("tokenizers")
    path = qwen_tokenizer_json(tmp_path)
    oracle = tokenizers.Tokenizer.from_file(str(path))
    oracle.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(300)])
    oracle.save(str(path))
    tok = build_tokenizer(str(tmp_path))
    turns = [f"<|im_start|>user\n{line}<|im_end|>\n" for line in corpus_lines()]

    def seconds(allow_special: bool) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for turn in turns:
                tok.encode(turn, bos=False, allow_special=allow_special)
            best = min(best, time.perf_counter() - start)
        return best

    assert seconds(True) < 3 * seconds(False)


def mistral_tokenizer_json(sp_model: Path, folder: Path, style: str) -> Path:
    """transformers' conversion of a Llama-2-style sentencepiece model (BPE, byte fallback), in the structure of
    Mistral 7B's tokenizer.json: v0.1 (a Prepend "▁" + Replace " " normalizer and no pre-tokenizer), v0.3 (a
    Metaspace pre-tokenizer, prepend_scheme "first", no split), or "always" (Metaspace prepending every piece);
    the decoder Replace/ByteFallback/Fuse/Strip and a "<s> $A" template."""
    from tokenizers import Tokenizer, processors
    from transformers import LlamaTokenizer

    (folder / "sp").mkdir(parents=True, exist_ok=True)
    (folder / "sp" / "tokenizer.model").write_bytes(sp_model.read_bytes())
    converted = LlamaTokenizer.from_pretrained(str(folder / "sp"), legacy=style == "always")
    spec = json.loads(converted.backend_tokenizer.to_str())
    if style == "v0.1":
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        spec["pre_tokenizer"] = None
    oracle = Tokenizer.from_str(json.dumps(spec))
    oracle.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    oracle.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "unk_token": "<unk>"}))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("style", ["v0.1", "v0.3", "always"])
def test_mistral_tokenizer_json_ids_match_tokenizers(sp_model: Path, tmp_path: Path, style: str):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    path = mistral_tokenizer_json(sp_model, tmp_path, style)
    spec = json.loads(path.read_text())
    assert (spec["normalizer"] is None) == (style != "v0.1") and spec["model"]["byte_fallback"]
    oracle = tokenizers.Tokenizer.from_file(str(path))
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFByteFallbackBPETokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (400, 1, 2, True)
    marked = MIXED + "</s><s> after" + "<s>" + MIXED
    assert tok.encode(marked, allow_special=True) == oracle.encode(marked).ids
    assert tok.encode(" leading space", allow_special=True) == oracle.encode(" leading space").ids
    oracle.encode_special_tokens = True
    ids = tok.encode(marked, bos=False)
    assert ids == oracle.encode(marked, add_special_tokens=False).ids
    assert spec["model"]["vocab"]["<0xF0>"] in ids  # the emoji's first byte: byte fallback was used
    assert tok.decode(ids) == oracle.decode(ids) == marked
    if style == "v0.3":  # the sentencepiece model itself agrees on plain text
        import sentencepiece as spm

        assert ids == spm.SentencePieceProcessor(model_file=str(sp_model)).encode(marked)


# ---------------------------------------------------------------- tiktoken's core for tokenizer.json


BUNDLED_TEXTS = sorted((REPO / "titan_lite" / "data" / "corpus").rglob("*.txt"))


# The single bytes SmolLM2's real vocabulary lacks as tokens.
SMOLLM2_MISSING_BYTES = [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]


def smollm2_tokenizer_json(folder: Path, missing: list[int] = ()) -> Path:
    """A byte-level BPE in SmolLM2's structure: Digits (individual) then ByteLevel with GPT-2's regex; ChatML specials
    trained into the vocabulary; without the single bytes `missing` (the training text holds none of them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    alphabet = byte_level_alphabet()
    initial = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - {alphabet[b] for b in missing})
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=QWEN_SPECIALS, initial_alphabet=initial,
                                  show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("layout", ["smollm2", "qwen"])
def test_tiktoken_core_ids_equal_tokenizers_on_bundled_texts_and_a_chat(tmp_path: Path, layout: str):
    """tokenizer.json byte-level BPE runs on tiktoken's core (the run's log says so) with the ids of `tokenizers`, on
    every bundled text (its first 40,000 characters: the test's time), on mixed scripts and numbers, and on a ChatML
    conversation rendered by its template."""
    tokenizers = pytest.importorskip("tokenizers")
    from titan_lite.data.chat import ChatTemplate

    path = (smollm2_tokenizer_json if layout == "smollm2" else qwen_tokenizer_json)(tmp_path)
    tok = build_tokenizer(str(tmp_path))
    assert describe_tokenizer(tok) == "tiktoken (tiktoken's core: ids in merge order, one split pattern)"
    oracle = tokenizers.Tokenizer.from_file(str(path))
    oracle.encode_special_tokens = True
    for text in [MIXED + " 2024 ١٢٣ ０１２  \n\n 3.14"] + [p.read_text()[:40_000] for p in BUNDLED_TEXTS]:
        assert tok.encode(text, bos=False) == oracle.encode(text, add_special_tokens=False).ids
    oracle.encode_special_tokens = False
    chat = ChatTemplate((REPO / "tests" / "chat_templates" / "chatml_smollm2.jinja").read_text(), {}, "chatml")
    rendered = chat.render([{"role": "system", "content": "Count 12 apples."}, {"role": "user", "content": MIXED},
                            {"role": "assistant", "content": "There are 12.\n#### 12"}], add_generation_prompt=False)
    ids = tok.encode(rendered, bos=False, allow_special=True)
    assert ids == oracle.encode(rendered, add_special_tokens=False).ids
    assert oracle.token_to_id("<|im_start|>") in ids


def test_tiktoken_core_runs_without_some_single_bytes_and_falls_back_per_text(tmp_path: Path):
    """SmolLM2's vocabulary lacks 21 single bytes: tiktoken's core still encodes (the log names the bytes), and a text
    holding one of them goes to the Python BPE: ids equal `tokenizers`' on every text, those included."""
    import pickle

    tokenizers = pytest.importorskip("tokenizers")
    path = smollm2_tokenizer_json(tmp_path, SMOLLM2_MISSING_BYTES)
    oracle = tokenizers.Tokenizer.from_file(str(path))
    assert all(oracle.token_to_id(byte_level_alphabet()[b]) is None for b in SMOLLM2_MISSING_BYTES)
    tok = build_tokenizer(str(tmp_path))
    assert describe_tokenizer(tok) == (
        "tiktoken (tiktoken's core: ids in merge order, one split pattern; a text holding one of the 21 bytes the "
        "vocabulary lacks as tokens (4, 6, 19-20, 22, 29, 192-193, 241-242, 245-255) is encoded in Python)")
    odd = ["a\x04b", "\x06 start", "tab\x13\x14 and \x16\x1d 12", chr(0x40000) + " plane 4", "x " + chr(0x8ABCD),
           "Café 日本語 \x04" + MIXED, "\x04"]
    texts = odd + [MIXED + " 2024 ١٢٣ ０１２  \n\n 3.14"] + [p.read_text()[:20_000] for p in BUNDLED_TEXTS]
    for copy in (tok, pickle.loads(pickle.dumps(tok))):
        for text in texts:
            assert copy.encode(text, bos=False) == oracle.encode(text, add_special_tokens=False).ids, text[:40]


def test_tiktoken_core_falls_back_where_the_pre_tokenizer_is_not_one_pattern(tmp_path: Path):
    tok = build_tokenizer(str(train_hf_tokenizer(tmp_path, "removed_nfkc", bos_template=False)))
    assert describe_tokenizer(tok) == ("python BPE (tiktoken's core would not be exact: the pre-tokenizer sequence "
                                       "Split + ByteLevel is not one split pattern)")


def test_every_tokenizer_pickles(tmp_path: Path, bundled, sp_model: Path):
    """DataLoader workers started by spawn or forkserver get the tokenizer pickled: each kind encodes alike after."""
    import pickle

    kinds = [bundled, build_tokenizer(str(sp_model)), build_tokenizer(str(qwen_tokenizer_json(tmp_path / "q"))),
             build_tokenizer(str(train_hf_tokenizer(tmp_path / "r", "removed_nfkc", bos_template=True)))]
    assert [t.backend for t in kinds] == ["tiktoken", "sentencepiece", "tiktoken", "python BPE"]
    for tok in kinds:
        copy = pickle.loads(pickle.dumps(tok))
        assert (copy.backend, copy.encode(TEXT, eos=True)) == (tok.backend, tok.encode(TEXT, eos=True))
