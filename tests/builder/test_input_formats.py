"""Input formats beyond JSON lines and parquet: each builds the cache a jsonl build of the
same texts builds (same documents, same ids, record indices counted per format)."""

from __future__ import annotations

import csv
import json

import pytest

from conftest import make_texts
from shardcache import open_cache


def _documents(cache_dir: str) -> dict[tuple[str, int], list[int]]:
    """(file stem, record) -> ids of every stored sequence (one piece each here)."""
    out = {}
    for seq in open_cache(cache_dir).iter_sequences():
        stem = seq.provenance.source.rsplit("/", 1)[-1].split(".")[0]
        out[(stem, seq.provenance.record)] = seq.ids.tolist()
    return out


def _jsonl_reference(tmp_path, build_cache, tokenizer_dir, texts_by_file):
    folder = tmp_path / "reference"
    folder.mkdir()
    for stem, texts in texts_by_file.items():
        with open(folder / f"{stem}.jsonl", "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
    return _documents(build_cache(str(folder), tokenizer_dir))


def test_arrow_and_feather_files_build_the_jsonl_cache(tmp_path, build_cache, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.feather as feather

    texts = {"a": make_texts(25, seed=1), "b": make_texts(20, seed=2)}
    folder = tmp_path / "arrow"
    folder.mkdir()
    table_a = pa.table({"id": list(range(25)), "text": texts["a"]})
    with pa.ipc.new_stream(str(folder / "a.arrow"), table_a.schema) as writer:  # stream layout
        for batch in table_a.to_batches(max_chunksize=7):
            writer.write_batch(batch)
    feather.write_feather(pa.table({"text": texts["b"]}), str(folder / "b.feather"),
                          chunksize=6)  # fmt: skip
    built = build_cache(str(folder), tokenizer_dir, batch_docs=4)
    assert _documents(built) == _jsonl_reference(tmp_path, build_cache, tokenizer_dir, texts)
    formats = {f["relpath"]: f["format"] for f in open_cache(built).manifest["inputs"]}
    assert formats == {"a.arrow": "arrow", "b.feather": "arrow"}


def test_hf_save_to_disk_folder_reads_its_data_files_not_its_metadata(
    tmp_path, build_cache, tokenizer_dir
):
    datasets = pytest.importorskip("datasets")
    texts = make_texts(40, seed=3)
    folder = tmp_path / "saved"
    ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(40))})
    ds.save_to_disk(str(folder), num_shards=2)
    built = build_cache(str(folder), tokenizer_dir)
    cache = open_cache(built)
    names = [f["relpath"] for f in cache.manifest["inputs"]]
    assert names == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert (
        cache.manifest["totals"]["documents"] == 40 and not cache.manifest["stats"]["bad_records"]
    )
    stored = sorted(_documents(built).values())
    reference = _jsonl_reference(tmp_path, build_cache, tokenizer_dir, {"all": texts})
    assert stored == sorted(reference.values())
    # a DatasetDict: every split's files, split by split
    datasets.DatasetDict({"train": ds.select(range(30)), "test": ds.select(range(30, 40))}
                         ).save_to_disk(str(tmp_path / "dict"))  # fmt: skip
    cache = open_cache(build_cache(str(tmp_path / "dict"), tokenizer_dir))
    assert (
        cache.manifest["totals"]["documents"] == 40 and not cache.manifest["stats"]["bad_records"]
    )


def test_text_files_are_one_document_each(tmp_path, build_cache, tokenizer_dir):
    texts = {f"doc{i}": t + "\n\nsecond paragraph\n" for i, t in enumerate(make_texts(6))}
    folder = tmp_path / "books"
    (folder / "src").mkdir(parents=True)
    for k, (stem, text) in enumerate(texts.items()):
        suffix = (".txt", ".md", ".py")[k % 3]
        sub = folder / "src" if suffix == ".py" else folder
        (sub / f"{stem}{suffix}").write_text(text, encoding="utf-8")
    inputs = [str(folder / "*.txt"), str(folder / "*.md"), str(folder / "src" / "**" / "*.py")]
    built = build_cache(inputs, tokenizer_dir)
    reference = _jsonl_reference(tmp_path, build_cache, tokenizer_dir,
                                 {stem: [t] for stem, t in texts.items()})  # fmt: skip
    assert _documents(built) == reference
    formats = {f["format"] for f in open_cache(built).manifest["inputs"]}
    assert formats == {"text"}


def test_text_files_are_not_picked_up_from_a_folder(tmp_path, build_cache, tokenizer_dir):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "the corpus"}) + "\n")
    (folder / "README.md").write_text("# not data\n")
    cache = open_cache(build_cache(str(folder), tokenizer_dir))
    assert [f["relpath"] for f in cache.manifest["inputs"]] == ["a.jsonl"]


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_csv_and_tsv_rows_build_the_jsonl_cache(tmp_path, build_cache, tokenizer_dir, fmt):
    texts = make_texts(30, seed=5)
    texts[3] = 'a "quoted" text,\nover two lines\twith a tab'
    path = tmp_path / f"table.{fmt}"
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="," if fmt == "csv" else "\t")
        writer.writerow(["id", "text"])
        writer.writerows([i, t] for i, t in enumerate(texts))
        writer.writerow([30, ""])  # an empty text: a bad record, as in jsonl
    built = build_cache(str(path), tokenizer_dir, batch_docs=8)
    reference = _jsonl_reference(tmp_path, build_cache, tokenizer_dir, {"table": texts})
    assert _documents(built) == reference
    cache = open_cache(built)
    assert cache.manifest["stats"]["bad_records"] == {"empty_text": 1}
    with open(f"{built}/quarantine.jsonl", encoding="utf-8") as f:
        [entry] = [json.loads(line) for line in f]
    assert entry["record"] == 30 and entry["row"] == 31
