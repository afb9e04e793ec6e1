"""Tests for fakeqemu._jsonstream: QMP input split into JSON texts as QEMU's streamer does.

Expected errors were measured by sending the same bytes to qemu-system-x86_64 7.2.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from fakeqemu import _jsonstream
from fakeqemu._jsonstream import ParsedObject, ParseError, QMPInputSplitter, StreamItem

QUERY = b'{"execute":"query-status"}'
PARSED_QUERY = ParsedObject({"execute": "query-status"})
EXPECTING_VALUE = ParseError("JSON parse error, expecting value")


def feed(*chunks: bytes) -> list[StreamItem]:
    """Everything one splitter produces from ``chunks``, fed in order."""
    splitter = QMPInputSplitter()
    items: list[StreamItem] = []
    for chunk in chunks:
        items.extend(splitter.feed(chunk))
    return items


def stray(token: str) -> ParseError:
    """QEMU's report of a lexical error at ``token``."""
    return ParseError(f"JSON parse error, stray '{token}'")


class CompleteTextTests(SynchronousTestCase):
    """A JSON text is complete when its brackets balance; no newline is needed."""

    def test_objectWithoutNewlineIsComplete(self) -> None:
        self.assertEqual(feed(QUERY), [PARSED_QUERY])

    def test_objectsBackToBackAreSeparate(self) -> None:
        self.assertEqual(feed(QUERY + QUERY), [PARSED_QUERY, PARSED_QUERY])

    def test_whitespaceAroundObjectsIsIgnored(self) -> None:
        self.assertEqual(feed(b" \r\n\t" + QUERY + b"\r\n \n"), [PARSED_QUERY])

    def test_nestedObjectCompletesAtTheOutermostBrace(self) -> None:
        text = b'{"execute":"ringbuf-read","arguments":{"device":"r0","size":[1,{"a":2}]}}'
        self.assertEqual(feed(text), [ParsedObject(json.loads(text))])

    def test_unbalancedObjectWaitsForMoreInput(self) -> None:
        self.assertEqual(feed(b"{bad json"), [])

    def test_unbalancedObjectIsParsedWhenItCloses(self) -> None:
        self.assertEqual(
            feed(b"{bad json", b"}\n"), [ParseError("JSON parse error, invalid keyword 'bad'")]
        )

    def test_objectSplitAcrossChunksIsReassembled(self) -> None:
        self.assertEqual(feed(QUERY[:5], QUERY[5:11], QUERY[11:]), [PARSED_QUERY])

    def test_stringsContainingBracesDoNotChangeDepth(self) -> None:
        self.assertEqual(feed(b'{"a":"}{[]"}'), [ParsedObject({"a": "}{[]"})])

    def test_escapedQuoteDoesNotEndAString(self) -> None:
        self.assertEqual(feed(b'{"a":"x\\"}"}'), [ParsedObject({"a": 'x"}'})])

    def test_escapedBackslashBeforeAQuoteEndsTheString(self) -> None:
        self.assertEqual(feed(b'{"a":"x\\\\"}'), [ParsedObject({"a": "x\\"})])

    def test_multibyteUtf8InAStringIsKept(self) -> None:
        self.assertEqual(
            feed('{"a":"caf\u00e9 \u20ac"}'.encode()), [ParsedObject({"a": "caf\u00e9 \u20ac"})]
        )

    def test_arrayAtDepthZeroIsATextOfItsOwn(self) -> None:
        self.assertEqual(feed(b"[1,2]"), [ParsedObject([1, 2])])

    def test_stringAtDepthZeroIsCompleteAtItsClosingQuote(self) -> None:
        self.assertEqual(feed(b'"str"'), [ParsedObject("str")])

    def test_numberAtDepthZeroEndsOnlyAtTheNextByte(self) -> None:
        splitter = QMPInputSplitter()
        self.assertEqual((splitter.feed(b"123"), splitter.feed(b" ")), ([], [ParsedObject(123)]))

    def test_keywordEndsAtAnOpeningBrace(self) -> None:
        self.assertEqual(
            feed(b"abc" + QUERY),
            [ParseError("JSON parse error, invalid keyword 'abc'"), PARSED_QUERY],
        )

    def test_literalKeywordsAreValues(self) -> None:
        self.assertEqual(
            feed(b"true null false "),
            [ParsedObject(True), ParsedObject(None), ParsedObject(False)],
        )

    def test_numberWithExponentIsOneToken(self) -> None:
        self.assertEqual(feed(b"-1.5E+3 "), [ParsedObject(-1500.0)])


class ErrorTests(SynchronousTestCase):
    """Parse and lexical errors, reported as QEMU reports them."""

    def test_closingBraceAtDepthZeroIsExpectingValue(self) -> None:
        self.assertEqual(feed(b"}"), [EXPECTING_VALUE])

    def test_closingBracketAtDepthZeroIsExpectingValue(self) -> None:
        self.assertEqual(feed(b"]"), [EXPECTING_VALUE])

    def test_keywordAtDepthZeroIsAnInvalidKeyword(self) -> None:
        self.assertEqual(feed(b"xyz\n"), [ParseError("JSON parse error, invalid keyword 'xyz'")])

    def test_loneSeparatorAtDepthZeroIsExpectingValue(self) -> None:
        self.assertEqual(feed(b":\n", b",\n"), [EXPECTING_VALUE, EXPECTING_VALUE])

    def test_streamContinuesAfterAParseError(self) -> None:
        self.assertEqual(feed(b"}" + QUERY), [EXPECTING_VALUE, PARSED_QUERY])

    def test_strayByteIsNamed(self) -> None:
        self.assertEqual(feed(b"@"), [stray("@")])

    def test_strayRunIsReportedOnce(self) -> None:
        self.assertEqual(feed(b"@@@" + QUERY), [stray("@"), PARSED_QUERY])

    def test_recoverySkipsPrintableInputUntilAControlCharacter(self) -> None:
        self.assertEqual(feed(b"@abc 123 xyz\n" + QUERY), [stray("@"), PARSED_QUERY])

    def test_recoveryWithoutAResynchronisationPointSwallowsEverything(self) -> None:
        self.assertEqual(feed(b"@abc 123 xyz"), [stray("@")])

    def test_recoveryLastsAcrossChunks(self) -> None:
        self.assertEqual(feed(b"@", b"tru", b"\n", QUERY), [stray("@"), PARSED_QUERY])

    def test_recoverySkipsTabs(self) -> None:
        self.assertEqual(feed(b"@\tabc" + QUERY), [stray("@"), PARSED_QUERY])

    def test_recoveryEndsAtAClosingBracket(self) -> None:
        self.assertEqual(feed(b"@ ]" + QUERY), [stray("@"), EXPECTING_VALUE, PARSED_QUERY])

    def test_recoveryEndsAtByteFF(self) -> None:
        self.assertEqual(feed(b"@x\xff"), [stray("@"), stray("\ufffd")])

    def test_controlCharacterEndsRecoveryAndIsItselfStray(self) -> None:
        self.assertEqual(feed(b"@\x01x"), [stray("@"), stray("\x01")])

    def test_strayControlCharacterIsNamed(self) -> None:
        self.assertEqual(feed(b"\x01" + QUERY), [stray("\x01"), PARSED_QUERY])

    def test_strayInvalidByteIsShownAsReplacementCharacter(self) -> None:
        self.assertEqual(feed(b"\xff" + QUERY), [stray("\ufffd"), PARSED_QUERY])

    def test_uppercaseLetterCannotStartAToken(self) -> None:
        self.assertEqual(feed(b"ABC\n"), [stray("A")])

    def test_plusAndDotCannotStartAToken(self) -> None:
        self.assertEqual(feed(b"+1\n", b".5\n"), [stray("+"), stray(".")])

    def test_strayByteInsideAnObjectDiscardsIt(self) -> None:
        # The rest of the object is skipped up to its closing brace, which then
        # stands alone at depth zero.
        self.assertEqual(feed(b'{"execute":@"query-status"}'), [stray("@"), EXPECTING_VALUE])

    def test_controlCharacterInAStringIsStrayAndNamesTheString(self) -> None:
        self.assertEqual(
            feed(b'"unterminated\n' + QUERY), [stray('"unterminated\n'), PARSED_QUERY]
        )

    def test_controlCharacterInAStringInsideAnObjectNamesOnlyTheString(self) -> None:
        self.assertEqual(feed(b'{"a":"b\x1f'), [stray('"b\x1f')])

    def test_nestingUpToTheLimitIsAccepted(self) -> None:
        depth = _jsonstream.MAX_NESTING
        [item] = feed(b"[" * depth + b"]" * depth)
        assert isinstance(item, ParsedObject)
        levels, value = 1, item.value
        while value:
            levels, value = levels + 1, value[0]
        self.assertEqual(levels, depth)

    def test_nestingBeyondTheLimitIsRefused(self) -> None:
        self.assertEqual(
            feed(b"[" * (_jsonstream.MAX_NESTING + 1)),
            [ParseError("JSON nesting depth limit exceeded")],
        )

    def test_streamContinuesAfterTheNestingLimit(self) -> None:
        self.assertEqual(
            feed(b"[" * (_jsonstream.MAX_NESTING + 1), QUERY),
            [ParseError("JSON nesting depth limit exceeded"), PARSED_QUERY],
        )

    def test_oversizedTextIsRefused(self) -> None:
        self.patch(_jsonstream, "MAX_PENDING_BYTES", 16)
        items = feed(b'["' + b"a" * 20 + b'"]\n')
        self.assertEqual(items[:1], [ParseError("JSON token size limit exceeded")])

    def test_textAtTheSizeLimitIsAccepted(self) -> None:
        self.patch(_jsonstream, "MAX_PENDING_BYTES", 16)
        self.assertEqual(feed(b'["' + b"a" * 12 + b'"]'), [ParsedObject(["a" * 12])])


_KEYS = st.text(st.sampled_from('ab{}[]"\\:, \u00e9'), max_size=6)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | _KEYS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_KEYS, children, max_size=3),
    max_leaves=8,
)
_OBJECTS = st.dictionaries(_KEYS, _JSON_VALUES, max_size=4)
_GARBAGE = st.sampled_from(
    [b"@", b"}", b"]", b"xyz\n", b"123 ", b'"str"', b":", b"\x01", b"\xff", b"\t", b"\n", b"A"]
)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (taken modulo its length)."""
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in pairwise(points)]


class ChunkingPropertyTests(SynchronousTestCase):
    """How the bytes arrive never changes what the streamer makes of them."""

    @given(st.lists(_OBJECTS, max_size=5), st.lists(st.integers(min_value=0), max_size=20))
    def test_objectsSurviveAnyChunking(
        self, objects: list[dict[str, Any]], cuts: list[int]
    ) -> None:
        stream = b"".join(json.dumps(o).encode() for o in objects)
        self.assertEqual(feed(*_split(stream, cuts)), [ParsedObject(o) for o in objects])

    @given(st.lists(_OBJECTS, max_size=5))
    def test_objectsSurviveByteAtATime(self, objects: list[dict[str, Any]]) -> None:
        stream = b"\n".join(json.dumps(o, ensure_ascii=False).encode() for o in objects)
        chunks = [stream[i : i + 1] for i in range(len(stream))]
        self.assertEqual(feed(*chunks), [ParsedObject(o) for o in objects])

    @given(
        st.lists(st.one_of(_OBJECTS.map(lambda o: json.dumps(o).encode()), _GARBAGE), max_size=8),
        st.lists(st.integers(min_value=0), max_size=20),
    )
    def test_errorsAndRecoveryDoNotDependOnChunking(
        self, pieces: list[bytes], cuts: list[int]
    ) -> None:
        stream = b"".join(pieces)
        self.assertEqual(feed(*_split(stream, cuts)), feed(stream))
