"""Real human translations, offline: English -> language pairs read from gettext `.mo` catalogs.

Why gettext. The paper trains one model on 102 languages -> English; this machine reaches no data hub,
but it does hold thousands of compiled gettext catalogs: every translated program installs
`<root>/<lang>/LC_MESSAGES/<domain>.mo` (GTK, glib, coreutils, iso-codes, ...), and Python packages
ship theirs too (Django alone: about 100 languages). Each catalog maps an English message (msgid)
to a translator's rendering (msgstr): real parallel text, with the long-tailed spread over languages
(tens of thousands of pairs for French or Ukrainian, a few hundred for Yoruba or Kashubian) that the
high- vs low-resource comparison needs.

Why a parser of our own instead of `gettext.GNUTranslations`: the standard class decodes the header
as UTF-8 before it has read the charset, so it raises on the many old catalogs written in Latin-1, and
it hides msgctxt and plural structure. The `.mo` format is a two-table binary file; reading it
directly is ~40 lines.

What a pair is (`catalog_pairs`):
- msgctxt ("context\\x04msgid") is dropped: the context disambiguates for translators, the English
  text is the msgid.
- Plural entries give two pairs: the singular msgid with the form the catalog uses for n=1, the plural
  msgid with the form it uses for n=5 (a representative plural count), both chosen by evaluating the
  catalog's own `Plural-Forms` formula (index 0 is the singular only in some languages: Arabic's form
  0 is for n=0).
- Whitespace runs (newlines of wrapped help texts, tabs) collapse to one space; other control
  characters (a terminal bell "\\a" in a message) are dropped.
- Skipped: empty translations, pairs where the translation equals the English (untranslated copies),
  messages with no letter outside their format placeholders ("%s: %s", "%d%%"), and messages longer
  than `max_chars` on either side (multi-paragraph `--help` texts are documents, not sentences).
- Format placeholders (`%s`, `%(name)s`, `{0}`) and UI mnemonics (`_Open`, `&File`) are KEPT:
  placeholders appear verbatim on both sides (a copy task, like names or numbers), mnemonics are part
  of what the translator wrote, and stripping placeholders would leave ungrammatical fragments
  ("Delete  files?") in both languages.

Languages are normalised (`normalize_language`): regions merge into their language (pt_BR -> pt,
es_AR -> es, de_CH -> de) because the task is "translate X to English", while a different script stays
a different source language (zh vs zh_Hant, sr vs sr_Latn). English catalogs (en_GB, en@quot) are
not source languages and are skipped.
"""
from __future__ import annotations

import functools
import gettext
import importlib.metadata
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# Directories where Debian-like systems keep compiled catalogs.
SYSTEM_LOCALE_DIRS: tuple[str, ...] = (
    "/usr/share/locale",
    "/usr/local/share/locale",
    "/usr/share/locale-langpack",
)

UNOWNED_PACKAGE = "(no Debian package owns it)"
MO_MAGIC_LE = 0x950412DE
MO_MAGIC_BE = 0xDE120495
PLURAL_COUNT_FOR_PLURAL_MSGID = 5  # the n whose form is paired with the English plural

# Locale names that are not "region variant of a language": script or legacy-code differences.
# Everything not listed here loses its region/modifier (pt_BR -> pt).
LANGUAGE_ALIASES: dict[str, str] = {
    "zh_cn": "zh", "zh_sg": "zh", "zh_hans": "zh",
    "zh_tw": "zh_Hant", "zh_hk": "zh_Hant", "zh_mo": "zh_Hant", "zh_hant": "zh_Hant",
    "sr@latin": "sr_Latn", "sr@latn": "sr_Latn", "sr_latn": "sr_Latn",
    "be@latin": "be_Latn", "uz@cyrillic": "uz_Cyrl", "tt@iqtelif": "tt_Latn",
    "pa_pk": "pa_Arab", "az_ir": "az_Arab",
    "no": "nb", "mo": "ro", "kmr": "ku",
}

_PLACEHOLDER = re.compile(
    r"%(\([^)]*\))?[-+ #0]*(\d+|\*)?(\.(\d+|\*))?[hlLqjzt]*[diouxXeEfFgGcrsa%]"  # printf / %(name)s
    r"|\{[^{}]*\}"                                                               # {0}, {name}
    r"|\$\{?\w+\}?"                                                              # $VAR, ${VAR}
)
_LETTER = re.compile(r"[^\W\d_]")
# C0/C1 control characters that are not whitespace (whitespace is collapsed by str.split instead).
_CONTROL_CHARACTERS = re.compile("[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f]")


@dataclass(frozen=True)
class Catalog:
    """One compiled catalog: where it is and who installed it (recorded in the corpus manifest)."""
    path: str
    locale: str      # the directory name: "pt_BR", "sr@latin"
    language: str    # normalised source language: "pt", "sr_Latn"
    domain: str      # file stem: "coreutils", "django"
    origin: str      # "system" (a locale dir) or "python" (an installed distribution)
    package: str     # the Debian package or Python distribution that installed the file
    version: str


class MoEntry(NamedTuple):
    """One catalog entry (a NamedTuple: catalogs hold millions of them)."""
    msgid: str
    msgid_plural: str | None
    msgstrs: tuple[str, ...]  # one string, or one per plural form


def normalize_language(locale: str) -> str | None:
    """`pt_BR` -> `pt`, `zh_TW` -> `zh_Hant`, `sr@latin` -> `sr_Latn`; None for English or junk."""
    name = locale.split(".", 1)[0]                      # drop an encoding suffix: zh_TW.Big5
    key = name.lower()
    if key in LANGUAGE_ALIASES:
        return LANGUAGE_ALIASES[key]
    base = re.split(r"[_@-]", key, maxsplit=1)[0]
    if base in LANGUAGE_ALIASES:
        return LANGUAGE_ALIASES[base]
    if base == "en" or not re.fullmatch(r"[a-z]{2,3}", base):
        return None
    return base


def read_mo(path: str | os.PathLike[str]) -> tuple[list[MoEntry], str | None]:
    """Parse a `.mo` file: its entries (header excluded) and its Plural-Forms expression (or None).

    Raises ValueError for a file that is not a valid catalog; entries that do not decode in the
    catalog's declared charset are skipped.
    """
    data = Path(path).read_bytes()
    if len(data) < 20:
        raise ValueError(f"{path}: too short to be a .mo catalog")
    magic = struct.unpack("<I", data[:4])[0]
    if magic == MO_MAGIC_LE:
        order = "<"
    elif magic == MO_MAGIC_BE:
        order = ">"
    else:
        raise ValueError(f"{path}: bad .mo magic number {magic:#x}")
    _revision, count, originals_at, translations_at = struct.unpack(order + "4I", data[4:20])

    try:
        originals = struct.unpack_from(f"{order}{2 * count}I", data, originals_at)
        translations = struct.unpack_from(f"{order}{2 * count}I", data, translations_at)
    except struct.error as error:
        raise ValueError(f"{path}: truncated table ({error})") from error
    if max(originals[1::2] + translations[1::2], default=0) > len(data):
        raise ValueError(f"{path}: string table points past the end of the file")

    def item(table: tuple[int, ...], i: int) -> bytes:
        return data[table[2 * i + 1]: table[2 * i + 1] + table[2 * i]]

    # Originals are sorted, so the header (msgid "") is entry 0 when present.
    header = item(translations, 0) if count and originals[0] == 0 else b""
    charset_match = re.search(rb"charset=([-\w]+)", header)
    charset = charset_match.group(1).decode("ascii") if charset_match else "utf-8"
    try:
        "".encode(charset)
    except LookupError:
        charset = "utf-8"
    plural_match = re.search(rb"plural=([^;\n]+)", header)
    plural = plural_match.group(1).decode("ascii", "replace").strip() if plural_match else None

    entries: list[MoEntry] = []
    for i in range(1 if header else 0, count):
        try:
            msgid_text, value_text = item(originals, i).decode(charset), item(translations, i).decode(charset)
        except UnicodeDecodeError:
            continue
        if "\x04" in msgid_text:
            msgid_text = msgid_text.split("\x04", 1)[1]       # drop msgctxt
        if "\x00" in msgid_text:
            msgid, _, msgid_plural = msgid_text.partition("\x00")
            entries.append(MoEntry(msgid, msgid_plural, tuple(value_text.split("\x00"))))
        else:
            entries.append(MoEntry(msgid_text, None, (value_text,)))
    return entries, plural


@functools.lru_cache(maxsize=256)
def _plural_function(expression: str | None):  # -> Callable[[int], int] | None
    if expression is None:
        return None
    try:
        return gettext.c2py(expression)
    except (ValueError, SyntaxError, RecursionError):
        return None


def _plural_indices(expression: str | None, forms: int) -> tuple[int, int]:
    """(form index for n=1, form index for the English plural) under the catalog's formula."""
    function = _plural_function(expression)
    if function is None:
        return 0, min(1, forms - 1)
    try:
        one, many = int(function(1)), int(function(PLURAL_COUNT_FOR_PLURAL_MSGID))
    except (ValueError, ZeroDivisionError, TypeError):
        return 0, min(1, forms - 1)
    return min(max(one, 0), forms - 1), min(max(many, 0), forms - 1)


def clean_text(text: str) -> str:
    """Drop control characters (terminal bells, escapes), collapse whitespace runs to one space."""
    return " ".join(_CONTROL_CHARACTERS.sub("", text).split())


def has_words(text: str) -> bool:
    """True when the text has a letter outside its format placeholders."""
    if "%" in text or "{" in text or "$" in text:
        text = _PLACEHOLDER.sub("", text)
    return _LETTER.search(text) is not None


def keep_pair(english: str, translation: str, max_chars: int) -> bool:
    return (bool(english) and bool(translation) and english != translation
            and len(english) <= max_chars and len(translation) <= max_chars and has_words(english))


def catalog_pairs(path: str | os.PathLike[str], max_chars: int = 256) -> list[tuple[str, str]]:
    """The cleaned (english, translation) pairs of one catalog, in file order."""
    entries, plural = read_mo(path)
    pairs = []
    for msgid, msgid_plural, msgstrs in entries:
        if msgid_plural is None:
            candidates: tuple[tuple[str, str], ...] = ((msgid, msgstrs[0]),)
        else:
            one, many = _plural_indices(plural, len(msgstrs))
            candidates = ((msgid, msgstrs[one]), (msgid_plural, msgstrs[many]))
        for english, translation in candidates:
            english, translation = clean_text(english), clean_text(translation)
            if keep_pair(english, translation, max_chars):
                pairs.append((english, translation))
    return pairs


def _mo_files_under(root: Path) -> Iterator[tuple[Path, str]]:
    """(path, locale) of every `<locale>/LC_MESSAGES/*.mo` below root."""
    for directory, subdirs, files in os.walk(root):
        subdirs.sort()
        if os.path.basename(directory) != "LC_MESSAGES":
            continue
        locale = os.path.basename(os.path.dirname(directory))
        for name in sorted(files):
            if name.endswith(".mo"):
                yield Path(directory) / name, locale


@functools.lru_cache(maxsize=1)
def _debian_owners() -> dict[str, tuple[str, str]]:
    """Map catalog path -> (Debian package, version), read from dpkg's database (empty elsewhere)."""
    info = Path("/var/lib/dpkg/info")
    status = Path("/var/lib/dpkg/status")
    if not info.is_dir() or not status.is_file():
        return {}
    versions: dict[str, str] = {}
    package = ""
    for line in status.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("Package: "):
            package = line[len("Package: "):].strip()
        elif line.startswith("Version: ") and package:
            versions[package] = line[len("Version: "):].strip()
    owners: dict[str, tuple[str, str]] = {}
    for listing in sorted(info.glob("*.list")):
        name = listing.stem.split(":", 1)[0]
        for line in listing.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.endswith(".mo") and "/LC_MESSAGES/" in line:
                owners[line] = (name, versions.get(name, ""))
    return owners


def system_catalogs(roots: Sequence[str | os.PathLike[str]] = SYSTEM_LOCALE_DIRS) -> list[Catalog]:
    """Catalogs in the system locale directories, with their owning Debian package when known."""
    owners = _debian_owners()
    catalogs = []
    for root in roots:
        if not Path(root).is_dir():
            continue
        for path, locale in _mo_files_under(Path(root)):
            language = normalize_language(locale)
            if language is None:
                continue
            package, version = owners.get(str(path), (UNOWNED_PACKAGE, ""))
            catalogs.append(Catalog(str(path), locale, language, path.stem, "system", package, version))
    return catalogs


def python_catalogs(distributions: Iterable[str] | None = None) -> list[Catalog]:
    """Catalogs shipped inside installed Python distributions (Django, Sphinx, ...).

    `distributions`: restrict to these distribution names (case-insensitive); None = all installed.
    """
    wanted = None if distributions is None else {d.lower() for d in distributions}
    catalogs: dict[str, Catalog] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if wanted is not None and name.lower() not in wanted:
            continue
        for file in dist.files or ():
            parts = file.parts
            if not file.name.endswith(".mo") or len(parts) < 3 or parts[-2] != "LC_MESSAGES":
                continue
            language = normalize_language(parts[-3])
            path = str(dist.locate_file(file))
            if language is None or not os.path.isfile(path):
                continue
            catalogs[path] = Catalog(path, parts[-3], language, Path(path).stem, "python",
                                     name, dist.version)
    return [catalogs[path] for path in sorted(catalogs)]


def find_catalogs(sources: Sequence[str] = ("system", "python"),
                  locale_dirs: Sequence[str | os.PathLike[str]] = SYSTEM_LOCALE_DIRS,
                  languages: Iterable[str] | None = None) -> list[Catalog]:
    """All catalogs of the chosen sources, sorted by (origin, path); `languages` filters them."""
    unknown = set(sources) - {"system", "python"}
    if unknown:
        raise ValueError(f"unknown gettext source(s) {sorted(unknown)}: use 'system' and/or 'python'")
    catalogs: list[Catalog] = []
    if "system" in sources:
        catalogs += system_catalogs(locale_dirs)
    if "python" in sources:
        catalogs += python_catalogs()
    if languages is not None:
        keep = set(languages)
        catalogs = [c for c in catalogs if c.language in keep]
    return sorted(catalogs, key=lambda c: (c.origin, c.path))
