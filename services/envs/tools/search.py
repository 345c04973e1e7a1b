"""Search a local document collection with BM25 (``rank-bm25``), standing in for web search offline.

The default collection is the trading catalogue shipped in the repository (services/envs/data/catalogue.jsonl,
one JSON object per line with ``title`` and ``text``); a subclass points ``collection`` at another file.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, ClassVar

from rank_bm25 import BM25Okapi

from services.envs.tools.base import Tool, ToolFailure

CATALOGUE = Path(__file__).resolve().parent.parent / "data" / "catalogue.jsonl"
WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


@functools.cache
def load_index(path: Path) -> tuple[BM25Okapi, list[dict[str, Any]]]:
    """The collection at ``path`` and its BM25 index (built once per process)."""
    docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return BM25Okapi([words(f"{d.get('title', '')} {d['text']}") for d in docs]), docs


class Search(Tool):
    name: ClassVar[str] = "search"
    description: ClassVar[str] = "Search the document collection; returns the best matching documents."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"query": {"type": "string", "description": "what to look for"},
                                         "k": {"type": "integer", "description": "how many results (1-5)"}},
        "required": ["query"]}
    collection: ClassVar[Path] = CATALOGUE

    async def call(self, arguments: dict[str, Any]) -> str:
        query, k = arguments.get("query"), arguments.get("k", 2)
        if not isinstance(query, str) or not words(query):
            raise ToolFailure('search takes {"query": "words to look for"}')
        if not isinstance(k, int) or not 1 <= k <= 5:
            raise ToolFailure("k must be an integer from 1 to 5")
        index, docs = load_index(self.collection)
        scores = index.get_scores(words(query))
        best = sorted(range(len(docs)), key=lambda i: -scores[i])[:k]
        hits = [f"[{docs[i].get('title', i)}] {docs[i]['text']}" for i in best if scores[i] > 0]
        return "\n".join(hits) or "no match"
