"""Answers matched as TEXT, on the device that generated the responses (no decode, no host round trip).

A model may emit the same text in many tokenizations ('####' as ['####'], ['##', '##'] or ['#', '###'];
' 72' as ['Ġ72'], ['Ġ', '72'] or ['Ġ7', '2']), and graders read text. So the text components turn tokens
into BYTES with a table of the vocabulary built once from the tokenizer (`VocabBytes`: token id -> its
bytes, byte-level BPE 'Ġ'-style characters, SentencePiece '▁' and <0xNN> byte tokens resolved, special
tokens -> no bytes), and match bytes:

  answer_after_marker  the number (or text) right after the LAST marker, however either was split;
  exact_match          the whole response (up to its first stop token) is the answer;
  contains             the answer occurs in the response as a whole number / word (windows around candidates);
  format               texts occur in order.

Numbers are compared in a canonical form computed on the device (`numbers`): leading spaces and '$' skipped,
commas dropped, trailing sentence punctuation ('.' or ','), trailing fractional zeros and a bare '.' dropped,
leading integer zeros dropped, so `$1,000.00`, `1000.` and `1000` are one number while `72` never equals `7`,
`720`, `7.2` or `-72`. The form is a few int64 chunks of decimal digit values, exact for any length.
docs/rewards.md lists the accepted forms.

Hot-path rules as in `tensor_native`: batched tensor code only (loops over static sizes: the marker length, a
format text's length), no `.item()` / `.tolist()` / `bool(tensor)` / `nonzero()` / boolean indexing, no
data-dependent shapes. Per call there is ONE pass over all [N, L] tokens (`scan`: one vocabulary lookup gives
each token's stop / can-end-a-marker / can-end-a-format-text bits; the first stop and candidate blocks come from
words of 4 or 8 such codes); then only windows are read, of fixed size: answer_after_marker reads the last
`MARKER_BLOCKS` candidate blocks and converts a window of tokens after the last marker to bytes; exact_match
converts the first tokens of a row; format runs each text's byte automaton over the first `FORMAT_BLOCKS`
candidate blocks after the previous text (or over every token when a text's last byte is common, see
FORMAT_WINDOW_MAX); contains looks up one more per-token code (the byte class of the token's first byte) and
converts short windows around the last `CONTAINS_WINDOWS` candidates. The answers' text is computed once per
PackedPatterns object (cached while the same tensors are passed again), in windows as wide as the batch's
longest answer when the host prepared the patterns (`TextMatcher.prepare`: AnswerHints read where they are
packed, so the device never syncs for them), else as wide as a static bound. The same code runs on every device.

The modules, from the bottom up:

  tables    lookups in 1-D tables, constant tables per device
  vocab     the vocabulary as bytes and byte automata; token rows -> bytes
  numbers   byte classes and numbers in canonical form
  answers   the answers as text (AnswerText, AnswerHints, PreparedText); does a text start with / equal one
  windows   the one pass over the tokens (scan), blocks and their windows, the last marker
  contains  an answer as a whole number / word, in windows around candidates
  formats   format texts in order
  matcher   TextMatcher: the components of one tokenizer and marker, their tables per device
"""

from rlhf_core.reward.text.answers import (
    ANSWER_MAX_BYTES,
    ANSWER_WINDOW_BYTES,
    CONTAINS_MAX_BYTES,
    AnswerHints,
    AnswerText,
    PreparedText,
    answer_text,
)
from rlhf_core.reward.text.contains import (
    CONTAINS_BLOCKS,
    CONTAINS_LEAD_BYTES,
    CONTAINS_TAIL_BYTES,
    CONTAINS_WINDOWS,
    contains_text,
    contains_windows,
)
from rlhf_core.reward.text.formats import FORMAT_BLOCKS, FORMAT_WINDOW_MAX, format_tokens, format_windows
from rlhf_core.reward.text.matcher import BUFFER_SHAPES, Rows, TextMatcher
from rlhf_core.reward.text.numbers import numbers
from rlhf_core.reward.text.vocab import (
    BYTES_PER_TOKEN,
    VocabBytes,
    full_text,
    gpt2_byte_decoder,
    token_bytes,
    tokens_to_bytes,
)
from rlhf_core.reward.text.windows import MARKER_BLOCK_TOKENS, MARKER_BLOCKS, last_marker, pick_blocks, scan

__all__ = [
    "ANSWER_MAX_BYTES",
    "ANSWER_WINDOW_BYTES",
    "BUFFER_SHAPES",
    "BYTES_PER_TOKEN",
    "CONTAINS_BLOCKS",
    "CONTAINS_LEAD_BYTES",
    "CONTAINS_MAX_BYTES",
    "CONTAINS_TAIL_BYTES",
    "CONTAINS_WINDOWS",
    "FORMAT_BLOCKS",
    "FORMAT_WINDOW_MAX",
    "MARKER_BLOCKS",
    "MARKER_BLOCK_TOKENS",
    "AnswerHints",
    "AnswerText",
    "PreparedText",
    "Rows",
    "TextMatcher",
    "VocabBytes",
    "answer_text",
    "contains_text",
    "contains_windows",
    "format_tokens",
    "format_windows",
    "full_text",
    "gpt2_byte_decoder",
    "last_marker",
    "numbers",
    "pick_blocks",
    "scan",
    "token_bytes",
    "tokens_to_bytes",
]
