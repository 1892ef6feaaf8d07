"""Damaged, truncated, foreign or empty ``.bin`` / ``.idx`` files (issue #29): one line naming
the file and what was expected, before Megatron's reader says "49 is not a valid DType" or
"cannot mmap an empty file" about nothing in particular.

The corpora are real: ``scripts/prepare_corpus.py``'s writer (Megatron's IndexedDatasetBuilder)
over a few short texts, then damaged the way a failed copy or a wrong path damages them.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import struct
from pathlib import Path

import pytest
from _runs import SMALL, cli

from nemo_msa.training.data import build_train_dataset
from nemo_msa.training.indexed_files import check_indexed_files
from nemo_msa.training.recipe import load_recipe
from nemo_msa.training.recipe_fields import RecipeError

REPO = Path(__file__).resolve().parents[2]
TEXTS = [b"def f(x):\n    return x + 1\n" * 3, b"import os\nprint(os.sep)\n",
         b"class A:\n    pass\n" * 5]


def _prepare_corpus():
    spec = importlib.util.spec_from_file_location("prepare_corpus",
                                                  REPO / "scripts" / "prepare_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus(directory: Path, texts=TEXTS) -> str:
    """A real indexed dataset of ``texts`` (byte tokens + EOD 256, uint16); its prefix."""
    info = _prepare_corpus().write_indexed_dataset(
        directory / "corpus", [(f"doc{i}", t) for i, t in enumerate(texts)])
    return info["prefix"]


def _text_as_idx(prefix: str) -> None:
    Path(prefix + ".idx").write_text("1 2 3 this is not an index\n" * 4)


def _empty_bin(prefix: str) -> None:
    Path(prefix + ".bin").write_bytes(b"")


def _truncated_bin(prefix: str) -> None:
    path = Path(prefix + ".bin")
    path.write_bytes(path.read_bytes()[:-10])


def _truncated_idx(prefix: str) -> None:
    path = Path(prefix + ".idx")
    path.write_bytes(path.read_bytes()[:-8])


def _short_idx(prefix: str) -> None:
    Path(prefix + ".idx").write_bytes(b"MMIDIDX\x00")


def _wrong_version(prefix: str) -> None:
    _patch(prefix + ".idx", 9, struct.pack("<Q", 7))


def _bad_dtype(prefix: str) -> None:
    _patch(prefix + ".idx", 17, bytes([49]))


def _bad_pointer(prefix: str) -> None:
    # The second sequence's pointer (after the header and the S int32 lengths).
    _patch(prefix + ".idx", 34 + 4 * len(TEXTS) + 8, struct.pack("<q", 3))


def _garbage_bin_of_another_size(prefix: str) -> None:
    Path(prefix + ".bin").write_bytes(bytes(range(256)) * 3)


def _missing_bin(prefix: str) -> None:
    Path(prefix + ".bin").unlink()


def _patch(path: str, offset: int, data: bytes) -> None:
    blob = bytearray(Path(path).read_bytes())
    blob[offset:offset + len(data)] = data
    Path(path).write_bytes(bytes(blob))


#: damage -> (the file named, what the message says was expected).
CASES = {
    "text as .idx": (_text_as_idx, ".idx", r"starts with b'1 2 3 thi', not the index magic "
                                           r"b'MMIDIDX\\x00\\x00' \(expected an index file "
                                           r"written by Megatron's IndexedDatasetBuilder"),
    "short .idx": (_short_idx, ".idx", r"is 8 bytes, too short for an index \(expected a 34-"
                                       r"byte header"),
    "wrong version": (_wrong_version, ".idx", r"has index version 7; expected version 1"),
    "dtype code 49": (_bad_dtype, ".idx", r"has token dtype code 49; expected one of 1 "
                                          r"\(uint8\), .*8 \(uint16\)"),
    "truncated .idx": (_truncated_idx, ".idx", r"is \d+ bytes but its header counts 3 sequences "
                                               r"and 4 document indices \(expected \d+ bytes\): "
                                               r"truncated, or not an index"),
    "bad pointer": (_bad_pointer, ".idx", r"points sequence 1 at byte 3; expected \d+, where "
                                          r"the sequence before it ends \(a damaged index\)"),
    "empty .bin": (_empty_bin, ".bin", r"is 0 bytes but its index corpus.idx describes \d+ "
                                       r"uint16 tokens \(\d+ bytes\): truncated, or the .bin "
                                       r"and .idx belong to different corpora"),
    "truncated .bin": (_truncated_bin, ".bin", r"is \d+ bytes but its index .* truncated"),
    "garbage .bin": (_garbage_bin_of_another_size, ".bin", r"is 768 bytes but its index .*: "
                                                           r"longer, or the .bin and .idx"),
    "missing .bin": (_missing_bin, ".bin", r"does not exist \(expected the .bin/.idx pair"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_files_are_named_with_what_was_expected(tmp_path, case):
    damage, suffix, expected = CASES[case]
    prefix = _corpus(tmp_path)
    check_indexed_files(prefix)  # the intact corpus passes
    damage(prefix)
    with pytest.raises(RecipeError) as err:
        check_indexed_files(prefix)
    msg = str(err.value)
    assert re.match(r"recipe key 'dataset.data_path': " + re.escape(prefix + suffix) + " "
                    + expected, msg), msg
    assert "\n" not in msg


def test_an_empty_corpus_is_refused(tmp_path):
    prefix = _corpus(tmp_path, texts=[])
    with pytest.raises(RecipeError, match=r"corpus.idx holds no documents \(0 sequences\): an "
                                          r"empty corpus; expected at least one document"):
        check_indexed_files(prefix)


def test_the_dataset_builder_checks_the_files_first(tmp_path):
    """Before, Megatron's own errors: 'N is not a valid DType', 'cannot mmap an empty file'."""
    prefix = _corpus(tmp_path)
    recipe = load_recipe(None, [f"dataset.data_path=[{prefix}]", "dataset.eod_id=256",
                                "model.vocab_size=257", "model.seq_length=16",
                                f"dataset.path_to_cache={tmp_path / 'cache'}"])
    assert len(build_train_dataset(recipe.dataset, recipe.gpt, seed=1, num_samples=4)) >= 4
    shutil.rmtree(tmp_path / "cache")
    _empty_bin(prefix)
    with pytest.raises(RecipeError, match=r"corpus.bin is 0 bytes but its index"):
        build_train_dataset(recipe.dataset, recipe.gpt, seed=1, num_samples=4)


@pytest.mark.parametrize("case", ["dtype code 49", "empty corpus"])
def test_cli_data_file_errors_are_one_line_and_exit_2(tmp_path, case, capsys):
    # The script's main() in this process (a traceback would be the exception escaping it).
    prefix = _corpus(tmp_path, texts=[] if case == "empty corpus" else TEXTS)
    if case in CASES:
        CASES[case][0](prefix)
    code = cli(*SMALL, "train.train_iters=2", f"dataset.data_path=[{prefix}]",
               "dataset.eod_id=256", "model.vocab_size=257",
               f"logger.output_dir={tmp_path / 'out'}")
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert re.match(r"error: recipe key 'dataset.data_path': .*corpus", errors[0]), errors[0]
