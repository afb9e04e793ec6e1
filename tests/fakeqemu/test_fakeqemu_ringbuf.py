"""Tests for fakeqemu._ringbuf: QEMU's ringbuf chardev, its base64 input and its utf8 output.

The expected values were measured on qemu-system-x86_64 7.2 with ``ringbuf-write``
(base64) followed by ``ringbuf-read``.
"""

from __future__ import annotations

import base64

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from fakeqemu._ringbuf import (
    DEFAULT_RINGBUF_SIZE,
    Base64Error,
    RingBuffer,
    decode_qmp_base64,
    encode_qmp_utf8,
)

INVALID_BASE64 = "Base64 data contains invalid characters"


class RingBufferTests(SynchronousTestCase):
    """The byte ring: drain on read, newest bytes kept on overflow."""

    def test_readReturnsOldestBytesFirst(self) -> None:
        ring = RingBuffer(16)
        ring.write(b"STARTED\n")
        self.assertEqual(ring.read(3), b"STA")

    def test_readDrainsWhatItReturns(self) -> None:
        ring = RingBuffer(16)
        ring.write(b"STARTED\n")
        ring.read(3)
        self.assertEqual((ring.read(100), ring.read(100)), (b"RTED\n", b""))

    def test_readOfEmptyRingIsEmpty(self) -> None:
        self.assertEqual(RingBuffer(16).read(16), b"")

    def test_writesAccumulate(self) -> None:
        ring = RingBuffer(16)
        ring.write(b"ab")
        ring.write(b"cd")
        self.assertEqual(ring.read(16), b"abcd")

    def test_overflowKeepsNewestBytes(self) -> None:
        ring = RingBuffer(16)
        ring.write(b"CONNECT 2:1234567\n")
        self.assertEqual(ring.read(100), b"NNECT 2:1234567\n")

    def test_overflowAcrossWritesKeepsNewestBytes(self) -> None:
        ring = RingBuffer(8)
        ring.write(b"012345")
        ring.write(b"6789")
        self.assertEqual(ring.read(100), b"23456789")

    def test_exactlyFullRingKeepsEverything(self) -> None:
        ring = RingBuffer(8)
        ring.write(b"01234567")
        self.assertEqual(ring.read(100), b"01234567")

    def test_drainingMakesRoomAgain(self) -> None:
        ring = RingBuffer(4)
        ring.write(b"abcd")
        ring.read(2)
        ring.write(b"ef")
        self.assertEqual(ring.read(100), b"cdef")

    def test_peekDoesNotDrain(self) -> None:
        ring = RingBuffer(16)
        ring.write(b"abc")
        self.assertEqual((ring.peek(), ring.read(16)), (b"abc", b"abc"))

    def test_lengthCountsBufferedBytes(self) -> None:
        ring = RingBuffer(4)
        ring.write(b"abcdef")
        self.assertEqual(len(ring), 4)

    def test_defaultSizeIs64KiB(self) -> None:
        self.assertEqual((DEFAULT_RINGBUF_SIZE, RingBuffer().size), (65536, 65536))

    def test_sizeMustBeAPowerOfTwo(self) -> None:
        error = self.assertRaises(ValueError, RingBuffer, 1000)
        self.assertEqual(str(error), "size of ringbuf chardev must be power of two")

    def test_negativeSizeIsRefused(self) -> None:
        self.assertRaises(ValueError, RingBuffer, -16)

    def test_powersOfTwoAreAccepted(self) -> None:
        self.assertEqual(
            [RingBuffer(n).size for n in (1, 2, 1024, 1 << 20)], [1, 2, 1024, 1 << 20]
        )

    def test_zeroSizedRingHoldsNothing(self) -> None:
        # QEMU accepts size=0 (0 passes its power-of-two test).
        ring = RingBuffer(0)
        ring.write(b"abc")
        self.assertEqual(ring.read(10), b"")

    @given(
        exponent=st.integers(min_value=0, max_value=8),
        writes=st.lists(st.binary(max_size=40), max_size=10),
    )
    def test_ringAlwaysHoldsTheNewestBytes(self, exponent: int, writes: list[bytes]) -> None:
        size = 1 << exponent
        ring = RingBuffer(size)
        for data in writes:
            ring.write(data)
        everything = b"".join(writes)
        self.assertEqual(ring.read(size), everything[max(0, len(everything) - size) :])


class Base64DecodingTests(SynchronousTestCase):
    """``ringbuf-write`` base64: QEMU's character check, then GLib's decoder."""

    def test_decodesPaddedBase64(self) -> None:
        self.assertEqual(decode_qmp_base64("YWJjZA=="), b"abcd")

    def test_emptyTextIsNoBytes(self) -> None:
        self.assertEqual(decode_qmp_base64(""), b"")

    def test_newlinesAreSkipped(self) -> None:
        self.assertEqual(
            [decode_qmp_base64("YWJj\nZGVm\n"), decode_qmp_base64("YWJj\n\n\nZA==")],
            [b"abcdef", b"abcd"],
        )

    def test_partialTrailingGroupIsDropped(self) -> None:
        self.assertEqual([decode_qmp_base64("YWJjZA"), decode_qmp_base64("Y")], [b"abc", b""])

    def test_groupShortOfItsPaddingIsDropped(self) -> None:
        self.assertEqual(decode_qmp_base64("YWJjZA="), b"abc")

    def test_paddingInsideAGroupSuppressesTheByteItPads(self) -> None:
        self.assertEqual([decode_qmp_base64("YW=j"), decode_qmp_base64("YQ=a")], [b"a#", b"a\x1a"])

    def test_decodingContinuesAfterAPaddedGroup(self) -> None:
        self.assertEqual(decode_qmp_base64("YQ==YWJj"), b"aabc")

    def test_paddingCountsAsAZeroDigit(self) -> None:
        self.assertEqual(
            [decode_qmp_base64("===="), decode_qmp_base64("=YWJ")], [b"\x00", b"\x01\x85\x89"]
        )

    def test_invalidCharactersAreRefused(self) -> None:
        for text in ("YWJj!", "YW JjZA==", "YWJj\r\nZA==", "YWJj\u00e9", "YW\x00J"):
            error = self.assertRaises(Base64Error, decode_qmp_base64, text)
            self.assertEqual(str(error), INVALID_BASE64)

    @given(st.binary(max_size=200))
    def test_standardEncodingRoundTrips(self, data: bytes) -> None:
        self.assertEqual(decode_qmp_base64(base64.b64encode(data).decode()), data)

    @given(st.binary(max_size=100), st.lists(st.integers(min_value=0, max_value=200)))
    def test_newlinesAnywhereDoNotChangeTheBytes(self, data: bytes, cuts: list[int]) -> None:
        text = base64.b64encode(data).decode()
        for cut in sorted(cuts, reverse=True):
            text = text[:cut] + "\n" + text[cut:]
        self.assertEqual(decode_qmp_base64(text), data)


class Utf8RenderingTests(SynchronousTestCase):
    """``ringbuf-read`` utf8: a C string, each bad sequence one U+FFFD, as QEMU renders it."""

    def test_asciiPassesThrough(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"STARTED\n"), "STARTED\n")

    def test_nulTruncates(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"ab\x00cd"), "ab")

    def test_leadingNulMakesAnEmptyString(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"\x00abc"), "")

    def test_validMultibyteCharactersAreDecoded(self) -> None:
        self.assertEqual(
            encode_qmp_utf8(b"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xc2\x80"),
            "caf\u00e9 \u20ac \U0001f600 \u0080",
        )

    def test_invalidBytesBecomeReplacementCharacters(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"x\xff\xfey\xc3"), "x\ufffd\ufffdy\ufffd")

    def test_eachStrayContinuationByteIsReplaced(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"\x80\x80x"), "\ufffd\ufffdx")

    def test_truncatedSequenceIsOneReplacement(self) -> None:
        self.assertEqual(
            [encode_qmp_utf8(b"\xe2\x82x"), encode_qmp_utf8(b"\xf0\x9f\x98x")],
            ["\ufffdx", "\ufffdx"],
        )

    def test_byteAfterATruncatedSequenceIsKept(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"a\xe2x\x82"), "a\ufffdx\ufffd")

    def test_characterSplitByADrainIsReplaced(self) -> None:
        # A read that stops inside a character, measured with a 3-byte read of "éé".
        self.assertEqual(
            [encode_qmp_utf8(b"\xc3\xa9\xc3"), encode_qmp_utf8(b"\xa9\xc3\xa9")],
            ["\u00e9\ufffd", "\ufffd\u00e9"],
        )

    def test_surrogateSequenceIsOneReplacement(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"\xed\xa0\x80x"), "\ufffdx")

    def test_beyondUnicodeIsOneReplacement(self) -> None:
        self.assertEqual(
            [
                encode_qmp_utf8(b"\xf4\x90\x80\x80x"),
                encode_qmp_utf8(b"\xf7\xbf\xbf\xbfx"),
                encode_qmp_utf8(b"\xf8\x88\x80\x80\x80x"),
            ],
            ["\ufffdx", "\ufffdx", "\ufffdx"],
        )

    def test_overlongSequenceIsOneReplacement(self) -> None:
        self.assertEqual(
            [encode_qmp_utf8(b"\xe0\x80\x80x"), encode_qmp_utf8(b"\xc1\xbfx")],
            ["\ufffdx", "\ufffdx"],
        )

    def test_modifiedUtf8NulIsU0000(self) -> None:
        self.assertEqual(encode_qmp_utf8(b"\xc0\x80x"), "\x00x")

    def test_noncharactersAreReplaced(self) -> None:
        self.assertEqual(
            [
                encode_qmp_utf8(b"\xef\xb7\x90x"),
                encode_qmp_utf8(b"\xef\xbf\xbex"),
                encode_qmp_utf8(b"\xf0\x9f\xbf\xbfx"),
            ],
            ["\ufffdx", "\ufffdx", "\ufffdx"],
        )

    @given(
        st.text(
            st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
            max_size=50,
        ).filter(
            lambda text: (
                not any(0xFDD0 <= ord(c) <= 0xFDEF or ord(c) & 0xFFFE == 0xFFFE for c in text)
            )
        )
    )
    def test_validUtf8RoundTrips(self, text: str) -> None:
        self.assertEqual(encode_qmp_utf8(text.encode("utf-8")), text)

    @given(st.binary(max_size=60), st.binary(max_size=20))
    def test_nothingAfterTheFirstNulIsRendered(self, before: bytes, after: bytes) -> None:
        head = before.split(b"\x00")[0]
        self.assertEqual(encode_qmp_utf8(head + b"\x00" + after), encode_qmp_utf8(head))

    @given(st.binary(max_size=60))
    def test_atMostOneCharacterPerByte(self, data: bytes) -> None:
        self.assertLessEqual(len(encode_qmp_utf8(data)), len(data))
