"""Local files: which files a path means, their format, and plain text read in bounded pieces.

A path (data.path, data.val_path) is a file, a folder (its files of one format, searched
recursively, hidden ones skipped) or a glob. The format goes by extension: .jsonl/.json, .csv and
.parquet are tables with a text column; .txt is plain text, and so is a single file of any other
extension. data.format names the format when extensions do not tell.
"""

from __future__ import annotations

import codecs
import errno
import glob
import logging
import os
import shlex
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from data.errors import DataError
from data.tokenizer import safe_pieces

FORMATS = {".txt": "txt", ".text": "txt", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
FORMAT_CHOICES = ("auto", *dict.fromkeys(FORMATS.values()))  # data.format: by the files' extensions, or one
READ_BYTES = 1 << 20
HEAD_BYTES = 8000  # how much of each file is looked at for NUL bytes, as git does to tell binary files

log = logging.getLogger(__name__)


def expand_paths(path, setting: str = "data.path", fmt: str = "auto") -> tuple[list[str], str]:
    """The files a path means, sorted, and their one format."""
    path = os.path.expanduser(str(path))
    files = files_named(path, setting, fmt)
    fmt = one_format(files, path, setting, fmt)
    check_not_empty(files, path, setting)
    heads = file_heads(files, setting)
    if fmt != "parquet":
        check_not_utf16_or_32(heads)
        check_no_nul_bytes(heads, setting if len(files) > 1 else "")
    return files, fmt


def files_named(path: str, setting: str, fmt: str) -> list[str]:
    """The files of a folder, a file or a glob, sorted."""
    if os.path.isdir(path):
        return files_in_folder(path, setting, fmt)
    if os.path.isfile(path):
        return [path]
    if glob.has_magic(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{setting} glob {path!r} matches no files; check the pattern")
        return files
    raise DataError(f"{setting} {path} {what_is_there(path)}; give a file, a folder or a glob")


def files_in_folder(path: str, setting: str, fmt: str) -> list[str]:
    """A folder's files of the format (any known one with fmt=auto), searched recursively, hidden ones
    skipped; the others it holds are named in one line, so that none is left out unnoticed."""
    root = Path(path)
    every = [
        p for p in root.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(root).parts)
    ]
    read = [p for p in every if p.suffix.lower() in FORMATS and fmt in ("auto", FORMATS[p.suffix.lower()])]
    files = sorted(map(str, read))
    chosen = set(read)
    others = Counter(p.suffix.lower() for p in every if p not in chosen)
    if not files:
        kinds = ".txt, .jsonl, .json, .csv or .parquet" if fmt == "auto" else f"{fmt} format"
        raise DataError(f"{setting} folder {path} holds no files of {kinds}{other_files(others, setting, path)}")
    if others:
        kind = format_of(files[0], fmt)
        log.info(
            "%s %s: reading %s, leaving out %s", setting, path, count(len(files), f"{kind} file"), described(others)
        )
    return files


def one_format(files: list[str], path: str, setting: str, fmt: str) -> str:
    """The format all the files share; files of several are refused."""
    formats = Counter(format_of(f, fmt) for f in files)
    if len(formats) > 1:
        found = ", ".join(f"{n} {kind}" for kind, n in formats.most_common())
        raise DataError(f"{setting} {path} mixes formats ({found}); choose one with data.format=txt|json|csv|parquet")
    return next(iter(formats))


def what_is_there(path: str) -> str:
    """What a path that is neither a file nor a folder names: nothing, a link to nothing, or something
    that is not a regular file (a pipe, a device, a socket)."""
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as err:
            if err.errno == errno.ELOOP:
                return "is a symbolic link that leads round in a loop"
        return f"is a symbolic link to {os.readlink(path)}, which does not exist"
    if os.path.lexists(path):
        return "is not a regular file (a pipe, a device or a socket: its text cannot be read twice, as a run reads it)"
    return "does not exist"


def described(extensions: Counter) -> str:
    """'12 .md files, 1 .py file', of the files a folder holds that are not read."""
    parts = [count(n, f"{ext or 'extensionless'} file") for ext, n in extensions.most_common(3)]
    rest = sum(extensions.values()) - sum(n for _, n in extensions.most_common(3))
    return ", ".join(parts) + (f" and {rest} more" if rest else "")


def other_files(extensions: Counter, setting: str, path: str) -> str:
    """What a folder that holds no files to read does hold, and how to give them."""
    if not extensions:
        return ""
    ext = next((e for e, _ in extensions.most_common() if e), "")
    how = f"; give those with a glob, e.g. {setting}='{path.rstrip('/')}/**/*{ext}'" if ext else ""
    return f" (it holds {described(extensions)}{how})"


def count(n: int, thing: str) -> str:
    return f"{n:,} {thing}{'' if n == 1 else 's'}"


def format_of(file: str, fmt: str = "auto") -> str:
    return fmt if fmt != "auto" else FORMATS.get(Path(file).suffix.lower(), "txt")


def check_not_empty(files: list[str], path: str, setting: str) -> None:
    if any(os.path.getsize(f) > 0 for f in files):
        return
    if len(files) == 1:
        raise DataError(f"{setting} file {files[0]} is empty; give a file with text in it")
    raise DataError(f"{setting} {path}: all {len(files)} files are empty")


UNICODE_MARKS = (  # a byte-order mark at the start of a file names its encoding (UTF-32's before UTF-16's,
    (codecs.BOM_UTF32_LE, "UTF-32"),  # which begins the same)
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def file_heads(files: list[str], setting: str) -> dict[str, bytes]:
    """The first bytes of each file, read now so that a file that cannot be read (no permission to,
    a disk error) is named before anything is made, rather than part way through tokenizing."""
    heads = {}
    for file in files:
        try:
            with open(file, "rb") as f:
                heads[file] = f.read(HEAD_BYTES)
        except OSError as err:
            denied = err.errno in (errno.EACCES, errno.EPERM)
            fix = f"make it readable (chmod a+r {shlex.quote(file)})" if denied else "check the disk it is on"
            if len(files) > 1:
                fix += f", or move it out of {setting}"
            raise DataError(f"{setting} file {file} cannot be read ({err.strerror or err}); {fix}") from None
    return heads


def check_not_utf16_or_32(heads: dict[str, bytes]) -> None:
    """A text file saved as UTF-16 or UTF-32 (as some Windows editors save it) is refused by the name of
    its encoding: read as UTF-8 it is every other byte zero, which data.errors=replace would train on."""
    for file, head in heads.items():
        encoding = next((name for mark, name in UNICODE_MARKS if head.startswith(mark)), None)
        if encoding is not None:
            raise DataError(
                f"{file} is {encoding} text (it starts with a {encoding} byte-order mark), not UTF-8; convert it "
                f"to UTF-8: {conversion(file, encoding)}"
            )


def check_no_nul_bytes(heads: dict[str, bytes], folder_setting: str) -> None:
    """NUL bytes are valid UTF-8 but no text has them: a file with one near its start is UTF-16 saved
    without a byte-order mark (every other byte zero) or not text at all, and would train as either."""
    for file, head in heads.items():
        at = head.find(b"\0")
        if at < 0:
            continue
        # ASCII in UTF-16LE has every odd byte zero and no even one; in UTF-16BE the other way round
        odd, even = (part.count(0) / max(1, len(part)) for part in (head[1::2], head[0::2]))
        encoding = "UTF-16LE" if odd > 0.9 and even < 0.1 else "UTF-16BE" if even > 0.9 and odd < 0.1 else None
        if encoding is not None:
            raise DataError(
                f"{file} holds NUL bytes (the first at byte {at}): it looks like {encoding} text without a "
                f"byte-order mark, not UTF-8; convert it to UTF-8: {conversion(file, encoding)}"
            )
        instead = f"move it out of {folder_setting}" if folder_setting else "give a text file"
        raise DataError(f"{file} holds NUL bytes (the first at byte {at}), so it is not text; {instead}")


def conversion(file: str, encoding: str) -> str:
    """The command that converts a file to UTF-8, beside it."""
    converted = f"{os.path.splitext(file)[0]}-utf8{os.path.splitext(file)[1]}"
    return f"iconv -f {encoding} -t UTF-8 {shlex.quote(file)} > {shlex.quote(converted)}"


def file_stats(files: list[str]) -> list[tuple[str, int, int]]:
    """What identifies the files' content cheaply, as make and git do: path, size, modification time."""
    stats = []
    for f in files:
        st = os.stat(f)
        stats.append((os.path.abspath(f), st.st_size, st.st_mtime_ns))
    return stats


# ---- reading -----------------------------------------------------------------------------------------


def read_text(path: str, errors: str = "strict") -> Iterator[str]:
    """The file decoded as UTF-8 a block at a time (a leading byte-order mark dropped). A byte that is
    not UTF-8 stops it with a DataError naming the file, the byte and its line, unless errors=replace."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            if offset == 0 and block.startswith(codecs.BOM_UTF8):
                block, offset = block[len(codecs.BOM_UTF8) :], len(codecs.BOM_UTF8)
            if (nul := block.find(b"\0")) >= 0:  # past the first bytes checked (check_no_nul_bytes): as it streams
                raise nul_byte(path, offset + nul)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous block
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise not_utf8(path, offset - pending + err.start) from None
            if text:
                yield text
            if not block:
                return
            offset += len(block)


def nul_byte(path: str, at: int) -> DataError:
    """A NUL byte past a file's first bytes, which looked like text: what follows is binary (a disk
    image, a database, a file zero-filled after a crash), which would train as text of NUL characters."""
    stem, ext = os.path.splitext(path)
    keep = f"head -c {at} {shlex.quote(path)} > {shlex.quote(f'{stem}-text{ext}')}"
    return DataError(
        f"{path} holds a NUL byte at byte {at}, so it is not text from there on; keep the text before it ({keep}) "
        "or leave the file out"
    )


def check_no_nul_characters(texts: list, files: list[str]) -> None:
    """A CSV reader passes a file's NUL bytes on as characters of its text (a JSON reader refuses
    them): texts holding one are refused by the file and byte the first comes from."""
    if not any(isinstance(text, str) and "\0" in text for text in texts):
        return
    for path in files:
        if (at := first_nul(path)) >= 0:
            raise nul_byte(path, at)
    raise DataError(f"{', '.join(files)}: a text holds a NUL character, so it is not text; leave it out")


def first_nul(path: str) -> int:
    """Where a file's first NUL byte is; -1 if it has none."""
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            if (at := block.find(b"\0")) >= 0:
                return offset + at
            offset += len(block)
    return -1


def not_utf8(path: str, at: int) -> DataError:
    with open(path, "rb") as f:
        head = f.read(at + 1)
    line = head.count(b"\n", 0, at) + 1
    return DataError(
        f"{path} is not UTF-8 text: byte {at} (line {line}) is 0x{head[at]:02x}; convert the file to UTF-8, "
        "or set data.errors=replace to read such bytes as U+FFFD"
    )


def find_not_utf8(files: list[str]) -> DataError | None:
    """The first file with a byte that is not UTF-8, as an error naming it; None if all are clean."""
    for path in files:
        try:
            for _ in read_text(path):
                pass
        except DataError as err:
            return err
    return None


LONGEST_UNCUT = 4_000_000  # characters of a document held at most while a safe place to cut it is looked for
_said_cut: set[str] = set()


def document_pieces(path: str, errors: str, piece_chars: int | None) -> Iterator[dict]:
    """A file as one document, in rows of about piece_chars characters cut where tokenizing the
    pieces gives the same ids as tokenizing the whole (tokenizer.safe_cut); piece_chars=None reads
    the whole file as one row. Rows after the first continue the document."""
    carry, first, forced = "", True, 0
    for text in read_text(path, errors):
        carry += text
        if piece_chars is None:
            continue
        pieces = safe_pieces(carry, piece_chars)
        carry = pieces.pop()  # where reading stopped is not known to be a safe place to cut
        if len(carry) > LONGEST_UNCUT:  # no safe place in it: cut anyway, at its last space if it has one
            cut = max(carry.rfind(" ", 0, LONGEST_UNCUT), carry.rfind("\n", 0, LONGEST_UNCUT) + 1)
            cut = cut if cut > 0 else LONGEST_UNCUT
            pieces.append(carry[:cut])
            carry, forced = carry[cut:], forced + 1
        for piece in pieces:
            yield {"text": piece, "continues": not first}
            first = False
    if carry:
        yield {"text": carry, "continues": not first}
    if forced and path not in _said_cut:  # (the tokenizer's training reads the file too: said once)
        _said_cut.add(path)
        log.warning(
            "%s has stretches of over %s characters with no place where a cut leaves the tokens as they are (a "
            "space between two letters, a newline before a letter); it was cut %d time(s) anyway, which may change "
            "a token or two at each cut",
            path,
            f"{LONGEST_UNCUT:,}",
            forced,
        )


def line_documents(path: str, errors: str) -> Iterator[dict]:
    """Every non-empty line of a file is a document (a Windows line end's \r dropped); a row holds
    the lines of one block read, joined by newlines."""
    carry = ""
    for text in read_text(path, errors):
        lines = (carry + text).replace("\r\n", "\n").split("\n")
        carry = lines.pop()  # the line this block cut, finished by the next one
        if chunk := "\n".join(filter(None, lines)):
            yield {"text": chunk, "continues": False}
    if carry := carry.removesuffix("\r"):
        yield {"text": carry, "continues": False}


def text_rows(files: list[str], one_document_per: str, errors: str, piece_chars: int | None) -> Iterator[dict]:
    """Rows of plain-text files, for datasets.IterableDataset.from_generator (which shards by file)."""
    for path in files:
        if one_document_per == "line":
            yield from line_documents(path, errors)
        else:
            yield from document_pieces(path, errors, piece_chars)
