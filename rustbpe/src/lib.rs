//! rustbpe: byte-level BPE training (and a reference encoder) for nanochat, exposed to Python with PyO3.
//!
//! Training reads any Python iterator of `str` in buffers, splits every text into chunks with a regex (the
//! GPT-4 style split pattern by default), counts the unique chunks in parallel, then runs the BPE merge loop on
//! the unique chunks weighted by their counts. The merge loop keeps pair counts up to date incrementally and
//! finds the most frequent pair with a max-heap whose stale entries are fixed lazily when they surface.
//!
//! Rules (the Python reference BPE in tests/reference_bpe.py implements the same ones):
//! - the count of a pair is the number of adjacent occurrences over all chunks (overlaps included, so "aaa"
//!   holds the pair (a, a) twice), weighted by how often the chunk occurs;
//! - each step merges the most frequent pair; among equally frequent pairs the smallest (left_id, right_id)
//!   wins, so training is deterministic;
//! - a merge replaces the occurrences of its pair left to right, non-overlapping ("aaa" -> "aa" "a").
//!
//! Inference in nanochat goes through tiktoken (built from `get_mergeable_ranks`); `encode` here applies the
//! same merges by rank and is what the tests compare tiktoken against.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use rayon::prelude::*;
use rustc_hash::FxHashMap;

/// GPT-4's (cl100k) split pattern.
const GPT4_PATTERN: &str =
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
/// nanochat's default: GPT-4's pattern with numbers split into groups of at most 2 digits (wastes fewer
/// tokens on number chunks with a small vocabulary).
const NANOCHAT_PATTERN: &str =
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";

type Pair = (u32, u32);

// -----------------------------------------------------------------------------------------------------------
// Splitting text into chunks

/// Splits text into chunks. The two GPT-4 style patterns run on a hand-written matcher (several times faster
/// than a regex engine, and the splitting is most of the training time); any other pattern runs on fancy-regex.
enum Splitter {
    /// GPT-4 style pattern; `max_digits` is the n of `\p{N}{1,n}`.
    Gpt4 {
        max_digits: usize,
    },
    Fancy(fancy_regex::Regex),
}

// Character classes, taken from regex-syntax (the Unicode tables the regex engines use) so that the
// hand-written matcher classifies every char exactly as `\p{L}`, `\p{N}` and `\s` do in fancy-regex.
const LETTER: u8 = 1; // \p{L}
const NUMBER: u8 = 2; // \p{N}
const SPACE: u8 = 4; // \s
const NEWLINE: u8 = 8; // [\r\n] (also SPACE)
const CI_S: u8 = 16; // (?i:[sdmt]), case-insensitively
const CI_L: u8 = 32; // (?i:l)
const CI_V_R: u8 = 64; // (?i:[vr])
const CI_E: u8 = 128; // (?i:e)

struct CharClasses {
    /// class bits of every char in the Basic Multilingual Plane (64 KiB, built once)
    bmp: Vec<u8>,
    /// sorted ranges for the chars above the BMP: (start, end, bits)
    astral: Vec<(u32, u32, u8)>,
}

fn unicode_ranges(pattern: &str) -> Vec<(u32, u32)> {
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("built-in class parses");
    match hir.kind() {
        regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(cls)) => cls
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        _ => panic!("{pattern} is not a Unicode class"),
    }
}

impl CharClasses {
    fn get() -> &'static CharClasses {
        static CLASSES: std::sync::OnceLock<CharClasses> = std::sync::OnceLock::new();
        CLASSES.get_or_init(|| {
            let classes = [
                (r"\p{L}", LETTER),
                (r"\p{N}", NUMBER),
                (r"\s", SPACE),
                (r"[\r\n]", NEWLINE),
                (r"(?i:[sdmt])", CI_S),
                (r"(?i:l)", CI_L),
                (r"(?i:[vr])", CI_V_R),
                (r"(?i:e)", CI_E),
            ];
            let mut bmp = vec![0u8; 0x10000];
            let mut astral = Vec::new();
            for (pattern, bit) in classes {
                for (start, end) in unicode_ranges(pattern) {
                    for c in start..=end.min(0xFFFF) {
                        bmp[c as usize] |= bit;
                    }
                    if end > 0xFFFF {
                        astral.push((start.max(0x10000), end, bit));
                    }
                }
            }
            // flatten overlapping astral ranges into disjoint ones carrying the union of their bits
            let mut cuts: Vec<u32> = astral.iter().flat_map(|&(s, e, _)| [s, e + 1]).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let mut flat = Vec::new();
            for w in cuts.windows(2) {
                let bits = astral
                    .iter()
                    .filter(|&&(s, e, _)| s <= w[0] && w[0] <= e)
                    .fold(0, |acc, &(_, _, b)| acc | b);
                if bits != 0 {
                    flat.push((w[0], w[1] - 1, bits));
                }
            }
            CharClasses { bmp, astral: flat }
        })
    }

    #[inline]
    fn of(&self, c: char) -> u8 {
        let c = c as u32;
        if c < 0x10000 {
            return self.bmp[c as usize];
        }
        match self.astral.binary_search_by(|&(s, e, _)| {
            if e < c {
                Ordering::Less
            } else if s > c {
                Ordering::Greater
            } else {
                Ordering::Equal
            }
        }) {
            Ok(i) => self.astral[i].2,
            Err(_) => 0,
        }
    }
}

/// The char at byte offset `i` (a char boundary) and its class bits.
#[inline]
fn char_at(cc: &CharClasses, text: &str, i: usize) -> (char, usize, u8) {
    let b = text.as_bytes()[i];
    if b < 0x80 {
        return (b as char, 1, cc.bmp[b as usize]);
    }
    let c = text[i..].chars().next().expect("i is a char boundary");
    (c, c.len_utf8(), cc.of(c))
}

/// End of the chunk that starts at byte `i` under the GPT-4 style pattern
///   '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,n}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+
/// tried alternative by alternative, as the backtracking engine does. Every char starts some match, so
/// this always returns an end > i.
fn gpt4_chunk_end(cc: &CharClasses, text: &str, i: usize, max_digits: usize) -> usize {
    let n = text.len();
    let (c, len, k) = char_at(cc, text, i);
    let after = i + len;
    // '(?i:[sdmt]|ll|ve|re)
    if c == '\'' && after < n {
        let (_, l1, k1) = char_at(cc, text, after);
        if k1 & CI_S != 0 {
            return after + l1;
        }
        if k1 & (CI_L | CI_V_R) != 0 && after + l1 < n {
            let (_, l2, k2) = char_at(cc, text, after + l1);
            let l_l = k1 & CI_L != 0 && k2 & CI_L != 0;
            let vr_e = k1 & CI_V_R != 0 && k2 & CI_E != 0;
            if l_l || vr_e {
                return after + l1 + l2;
            }
        }
    }
    // [^\r\n\p{L}\p{N}]?+\p{L}+
    let letters_from = |mut j: usize| {
        while j < n {
            let (_, l, kj) = char_at(cc, text, j);
            if kj & LETTER == 0 {
                break;
            }
            j += l;
        }
        j
    };
    if k & LETTER != 0 {
        return letters_from(after);
    }
    if k & (NEWLINE | NUMBER) == 0 && after < n && char_at(cc, text, after).2 & LETTER != 0 {
        return letters_from(after);
    }
    // \p{N}{1,n}
    if k & NUMBER != 0 {
        let (mut j, mut digits) = (after, 1);
        while digits < max_digits && j < n {
            let (_, l, kj) = char_at(cc, text, j);
            if kj & NUMBER == 0 {
                break;
            }
            j += l;
            digits += 1;
        }
        return j;
    }
    //  ?[^\s\p{L}\p{N}]++[\r\n]*
    let punct = |kj: u8| kj & (SPACE | LETTER | NUMBER) == 0;
    let p = if c == ' ' { after } else { i };
    if p < n && punct(char_at(cc, text, p).2) {
        let mut j = p;
        while j < n {
            let (_, l, kj) = char_at(cc, text, j);
            if !punct(kj) {
                break;
            }
            j += l;
        }
        while j < n && matches!(text.as_bytes()[j], b'\r' | b'\n') {
            j += 1;
        }
        return j;
    }
    // What is left is a whitespace char (every other char matched above). Scan its whole run.
    debug_assert!(k & SPACE != 0);
    let (mut j, mut last_newline_end, mut last_start, mut chars) = (i, 0, i, 0usize);
    while j < n {
        let (_, l, kj) = char_at(cc, text, j);
        if kj & SPACE == 0 {
            break;
        }
        if kj & NEWLINE != 0 {
            last_newline_end = j + l;
        }
        last_start = j;
        chars += 1;
        j += l;
    }
    // \s*[\r\n]: up to the last newline of the run
    if last_newline_end > 0 {
        return last_newline_end;
    }
    // \s+(?!\S): the run, less its last char when a non-space follows (that char then leads the next chunk)
    if j < n && chars >= 2 {
        return last_start;
    }
    // \s+
    j
}

impl Splitter {
    fn new(pattern: &str) -> Result<Splitter, String> {
        if pattern == NANOCHAT_PATTERN {
            return Ok(Splitter::Gpt4 { max_digits: 2 });
        }
        if pattern == GPT4_PATTERN {
            return Ok(Splitter::Gpt4 { max_digits: 3 });
        }
        if pattern.is_empty() {
            return Err("the split pattern is empty; pass None for the default GPT-4 style pattern".to_string());
        }
        fancy_regex::Regex::new(pattern)
            .map(Splitter::Fancy)
            .map_err(|e| format!("invalid split pattern {pattern:?}: {e}"))
    }

    /// Calls `f` on every non-empty chunk of `text`, in order.
    fn split<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) -> Result<(), String> {
        match self {
            Splitter::Gpt4 { max_digits } => {
                let cc = CharClasses::get();
                let mut pos = 0;
                while pos < text.len() {
                    let end = gpt4_chunk_end(cc, text, pos, *max_digits);
                    f(&text[pos..end]);
                    pos = end;
                }
                Ok(())
            }
            Splitter::Fancy(re) => {
                for m in re.find_iter(text) {
                    let m = m.map_err(|e| format!("split pattern failed while matching: {e}"))?;
                    if !m.as_str().is_empty() {
                        f(m.as_str());
                    }
                }
                Ok(())
            }
        }
    }
}

// -----------------------------------------------------------------------------------------------------------
// The merge loop

/// A pair (left_id, right_id) packed as left << 32 | right: hashes fast, and orders like the tuple.
type PairKey = u64;

#[inline]
fn key(a: u32, b: u32) -> PairKey {
    (a as u64) << 32 | b as u64
}

#[inline]
fn unkey(k: PairKey) -> Pair {
    ((k >> 32) as u32, k as u32)
}

/// One heap entry: a pair and its count when pushed. Counts only ever go down for a pair already in the heap
/// (a merge only creates pairs that contain the new token), so an entry whose count no longer matches is
/// stale-high: it is re-pushed with the current count when it reaches the top.
#[derive(Eq, PartialEq)]
struct HeapItem {
    count: i64,
    pair: PairKey,
}

impl Ord for HeapItem {
    fn cmp(&self, other: &Self) -> Ordering {
        // max-heap on count; on a tie the smaller pair is "greater" so it pops first
        self.count.cmp(&other.count).then_with(|| other.pair.cmp(&self.pair))
    }
}

impl PartialOrd for HeapItem {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The unique chunks, all in one flat array: word w is `[len, count_lo, count_hi, id, id, ...]` at
/// `offsets[w]`, with room for its original length (merges only shrink a word, in place). The merge loop is
/// bound by memory latency (it hops between words); one record per word, in one allocation, means one
/// cache miss per word visited instead of three (Vec header, ids, count).
struct Words {
    data: Vec<u32>,
    offsets: Vec<usize>,
}

const HEADER: usize = 3;

impl Words {
    fn new(chunks: impl Iterator<Item = (Vec<u8>, i64)>) -> Words {
        let (mut data, mut offsets) = (Vec::new(), Vec::new());
        for (bytes, count) in chunks {
            offsets.push(data.len());
            data.push(bytes.len() as u32);
            data.push(count as u64 as u32);
            data.push((count as u64 >> 32) as u32);
            data.extend(bytes.iter().map(|&b| b as u32));
        }
        Words { data, offsets }
    }

    fn len(&self) -> usize {
        self.offsets.len()
    }

    #[inline]
    fn count(&self, w: usize) -> i64 {
        let o = self.offsets[w];
        (self.data[o + 1] as u64 | (self.data[o + 2] as u64) << 32) as i64
    }

    #[inline]
    fn ids(&self, w: usize) -> &[u32] {
        let o = self.offsets[w];
        &self.data[o + HEADER..o + HEADER + self.data[o] as usize]
    }
}

const PREFETCH_DISTANCE: usize = 8;

#[inline(always)]
fn prefetch(x: &u32) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unused_unsafe)]
    // SAFETY: a prefetch is only a hint; it reads nothing and the pointer comes from a live reference.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(x as *const u32 as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Runs up to `num_merges` BPE merges over the unique chunks. `progress(done, total, pair, count)` is called
/// after every merge and may stop training by returning an error.
fn merge_loop(
    mut words: Words,
    num_merges: usize,
    mut progress: impl FnMut(usize, usize, Pair, i64) -> Result<(), PyErr>,
) -> Result<Vec<Pair>, PyErr> {
    // Initial pair counts, and for each pair the words that hold it, counted in parallel.
    type Stats = (FxHashMap<PairKey, i64>, FxHashMap<PairKey, Vec<u32>>);
    let (mut pair_counts, mut where_) = (0..words.len())
        .into_par_iter()
        .with_min_len(1024)
        .fold(Stats::default, |(mut counts, mut where_): Stats, w| {
            let c = words.count(w);
            for win in words.ids(w).windows(2) {
                let k = key(win[0], win[1]);
                *counts.entry(k).or_insert(0) += c;
                let list = where_.entry(k).or_default();
                if list.last() != Some(&(w as u32)) {
                    list.push(w as u32);
                }
            }
            (counts, where_)
        })
        .reduce(Stats::default, |(mut ca, mut wa), (mut cb, mut wb)| {
            if ca.len() < cb.len() {
                std::mem::swap(&mut ca, &mut cb);
                std::mem::swap(&mut wa, &mut wb);
            }
            for (k, c) in cb {
                *ca.entry(k).or_insert(0) += c;
            }
            for (k, list) in wb {
                wa.entry(k).or_default().extend(list);
            }
            (ca, wa)
        });

    let mut heap: BinaryHeap<HeapItem> = pair_counts
        .iter()
        .filter(|(_, &c)| c > 0)
        .map(|(&pair, &count)| HeapItem { count, pair })
        .collect();

    let mut merges: Vec<Pair> = Vec::with_capacity(num_merges);
    let mut created: Vec<PairKey> = Vec::new();
    while merges.len() < num_merges {
        let Some(top) = heap.pop() else { break };
        let current = pair_counts.get(&top.pair).copied().unwrap_or(0);
        if current != top.count {
            if current > 0 {
                heap.push(HeapItem {
                    count: current,
                    pair: top.pair,
                });
            }
            continue;
        }
        let (a, b) = unkey(top.pair);
        let new_id = 256 + merges.len() as u32;
        merges.push((a, b));
        // every occurrence gets merged below, so the pair is gone afterwards
        pair_counts.remove(&top.pair);
        let word_list = where_.remove(&top.pair).unwrap_or_default();

        created.clear();
        for (idx, &w) in word_list.iter().enumerate() {
            // The loop is bound by the cache misses on the word records: ask for one a few words ahead.
            if let Some(&ahead) = word_list.get(idx + PREFETCH_DISTANCE) {
                prefetch(&words.data[words.offsets[ahead as usize]]);
            }
            let o = words.offsets[w as usize];
            let n = words.data[o] as usize;
            let c = (words.data[o + 1] as u64 | (words.data[o + 2] as u64) << 32) as i64;
            let word = &mut words.data[o + HEADER..o + HEADER + n];

            // Pass 1 (read only): find the merge sites left to right and take away every old pair that
            // touches one (the pair before the site, the pair itself, the pair after), each pair once.
            let mut found = false;
            let mut last_q: isize = -1;
            let mut i = 0;
            while i + 1 < n {
                if word[i] == a && word[i + 1] == b {
                    found = true;
                    for q in [i as isize - 1, i as isize, i as isize + 1] {
                        if q > last_q && q >= 0 && (q as usize) + 1 < n {
                            let q = q as usize;
                            let k = key(word[q], word[q + 1]);
                            if k != top.pair {
                                if let Some(x) = pair_counts.get_mut(&k) {
                                    *x -= c;
                                }
                            }
                            last_q = q as isize;
                        }
                    }
                    i += 2;
                } else {
                    i += 1;
                }
            }
            if !found {
                continue; // an earlier merge changed this word since it was listed
            }

            // Pass 2: replace the sites in place.
            let (mut r, mut out) = (0, 0);
            while r < n {
                if r + 1 < n && word[r] == a && word[r + 1] == b {
                    word[out] = new_id;
                    r += 2;
                } else {
                    word[out] = word[r];
                    r += 1;
                }
                out += 1;
            }
            let m = out;

            // Pass 3: add every new pair (those touching a new token), each once, and list this word for it.
            let mut last_q: isize = -1;
            for j in 0..m {
                if word[j] != new_id {
                    continue;
                }
                for q in [j as isize - 1, j as isize] {
                    if q > last_q && q >= 0 && (q as usize) + 1 < m {
                        let q = q as usize;
                        let k = key(word[q], word[q + 1]);
                        let list = where_.entry(k).or_default();
                        if list.is_empty() {
                            created.push(k);
                        }
                        if list.last() != Some(&w) {
                            list.push(w);
                        }
                        *pair_counts.entry(k).or_insert(0) += c;
                        last_q = q as isize;
                    }
                }
            }
            words.data[o] = m as u32;
        }
        for &k in &created {
            let count = pair_counts.get(&k).copied().unwrap_or(0);
            if count > 0 {
                heap.push(HeapItem { count, pair: k });
            }
        }
        progress(merges.len(), num_merges, (a, b), top.count)?;
    }
    Ok(merges)
}

// -----------------------------------------------------------------------------------------------------------
// Python side

fn log(py: Python<'_>, level: u32, msg: &str) {
    // Logging must never break training: a failing logger is ignored.
    let _ = (|| -> PyResult<()> {
        let logger = py.import("logging")?.call_method1("getLogger", ("rustbpe",))?;
        logger.call_method1("log", (level, msg))?;
        Ok(())
    })();
}

const INFO: u32 = 20;
const WARNING: u32 = 30;

/// Byte-level BPE tokenizer: train it on text, then export its merges (for tiktoken) or encode with it.
#[pyclass(module = "rustbpe")]
pub struct Tokenizer {
    pattern: String,
    splitter: Splitter,
    /// merges[i] = the pair merged into token 256 + i
    merges: Vec<Pair>,
    /// pair -> the token it merges into (its rank is that id - 256)
    merge_ids: FxHashMap<Pair, u32>,
    /// bytes of every token id
    token_bytes: Vec<Vec<u8>>,
}

impl Tokenizer {
    fn with_pattern(pattern: &str) -> Result<Tokenizer, String> {
        Ok(Tokenizer {
            pattern: pattern.to_string(),
            splitter: Splitter::new(pattern)?,
            merges: Vec::new(),
            merge_ids: FxHashMap::default(),
            token_bytes: (0..=255u8).map(|b| vec![b]).collect(),
        })
    }

    fn set_merges(&mut self, merges: Vec<Pair>) {
        self.token_bytes.truncate(256);
        self.merge_ids.clear();
        for (i, &(a, b)) in merges.iter().enumerate() {
            let mut bytes = self.token_bytes[a as usize].clone();
            bytes.extend_from_slice(&self.token_bytes[b as usize]);
            self.token_bytes.push(bytes);
            self.merge_ids.insert((a, b), 256 + i as u32);
        }
        self.merges = merges;
    }

    /// Appends the ids of one chunk to `out`: its bytes, then the merges applied in rank order (the
    /// lowest-ranked pair present is merged everywhere, left to right, then the next). This is what training
    /// did to every chunk. Works in place on the tail of `out` (no allocation per chunk).
    fn encode_chunk(&self, chunk: &[u8], out: &mut Vec<u32>) {
        let start = out.len();
        out.extend(chunk.iter().map(|&b| b as u32));
        let ids = &mut out[start..];
        let mut n = ids.len();
        while n >= 2 {
            let mut best: Option<(u32, Pair)> = None;
            for win in ids[..n].windows(2) {
                if let Some(&id) = self.merge_ids.get(&(win[0], win[1])) {
                    if best.is_none_or(|(bid, _)| id < bid) {
                        best = Some((id, (win[0], win[1])));
                    }
                }
            }
            let Some((new_id, (a, b))) = best else { break };
            let (mut r, mut w) = (0, 0);
            while r < n {
                if r + 1 < n && ids[r] == a && ids[r + 1] == b {
                    ids[w] = new_id;
                    r += 2;
                } else {
                    ids[w] = ids[r];
                    r += 1;
                }
                w += 1;
            }
            n = w;
        }
        out.truncate(start + n);
    }

    fn encode_str(&self, text: &str) -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.splitter
            .split(text, |chunk| self.encode_chunk(chunk.as_bytes(), &mut out))?;
        Ok(out)
    }
}

/// Adds the chunk counts of a buffer of texts to `counts`: counted in parallel with borrowed keys, then
/// merged (a new chunk is copied once).
fn count_into(counts: &mut FxHashMap<String, i64>, splitter: &Splitter, texts: &[String]) -> Result<(), String> {
    let local = texts
        .par_iter()
        .with_min_len(16)
        .try_fold(FxHashMap::default, |mut acc: FxHashMap<&str, i64>, text| {
            splitter.split(text, |chunk| *acc.entry(chunk).or_insert(0) += 1)?;
            Ok::<_, String>(acc)
        })
        .try_reduce(FxHashMap::default, |mut a, mut b| {
            if a.len() < b.len() {
                std::mem::swap(&mut a, &mut b);
            }
            for (k, v) in b {
                *a.entry(k).or_insert(0) += v;
            }
            Ok(a)
        })?;
    for (k, v) in local {
        match counts.get_mut(k) {
            Some(x) => *x += v,
            None => {
                counts.insert(k.to_owned(), v);
            }
        }
    }
    Ok(())
}

#[pymethods]
impl Tokenizer {
    /// A tokenizer with no merges yet (256 byte tokens) and the default split pattern.
    #[new]
    fn new() -> Self {
        Tokenizer::with_pattern(NANOCHAT_PATTERN).expect("the default pattern compiles")
    }

    /// Trains byte-level BPE on the texts of `iterator` (any Python iterator of str) up to `vocab_size`
    /// tokens (256 bytes + merges). Texts are pulled `buffer_size` at a time (the GIL is held only for that),
    /// split with `pattern` (None: nanochat's GPT-4 style pattern) and counted in parallel. Replaces any
    /// earlier training. If the text runs out of pairs before `vocab_size`, training stops early with a
    /// warning and `vocab_size` tells how many tokens there are.
    #[pyo3(signature = (iterator, vocab_size, buffer_size = 8192, pattern = None))]
    fn train_from_iterator(
        &mut self,
        py: Python<'_>,
        iterator: &Bound<'_, PyAny>,
        vocab_size: i64,
        buffer_size: i64,
        pattern: Option<String>,
    ) -> PyResult<()> {
        if vocab_size < 256 {
            return Err(PyValueError::new_err(format!(
                "vocab_size must be at least 256 (the byte tokens), got {vocab_size}"
            )));
        }
        if vocab_size > u32::MAX as i64 / 2 {
            return Err(PyValueError::new_err(format!("vocab_size {vocab_size} is too large")));
        }
        if buffer_size < 1 {
            return Err(PyValueError::new_err(format!(
                "buffer_size must be at least 1, got {buffer_size}"
            )));
        }
        let pattern = pattern.unwrap_or_else(|| NANOCHAT_PATTERN.to_string());
        let splitter = Splitter::new(&pattern).map_err(PyValueError::new_err)?;
        let mut iter = iterator.try_iter().map_err(|_| {
            PyTypeError::new_err(format!(
                "train_from_iterator needs an iterable of str, got {}",
                iterator.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?;

        let t0 = Instant::now();
        let (mut n_texts, mut n_bytes) = (0usize, 0usize);
        let mut last_log = Instant::now();
        // Pipelined: a worker thread counts buffer k (in parallel, with rayon) while this thread, holding the
        // GIL, pulls buffer k + 1 from the Python iterator (which may be reading parquet files).
        let chunk_counts = std::thread::scope(|scope| -> PyResult<FxHashMap<String, i64>> {
            let mut counts = Some(FxHashMap::<String, i64>::default());
            let mut pending: Option<std::thread::ScopedJoinHandle<'_, Result<FxHashMap<String, i64>, String>>> = None;
            loop {
                let mut buffer: Vec<String> = Vec::with_capacity((buffer_size as usize).min(1 << 16));
                while buffer.len() < buffer_size as usize {
                    let Some(item) = iter.next() else { break };
                    let item = item?;
                    let s = item.cast::<PyString>().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "train_from_iterator: item {} is {}, expected str",
                            n_texts + buffer.len(),
                            item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                        ))
                    })?;
                    buffer.push(s.to_str()?.to_owned());
                }
                if let Some(handle) = pending.take() {
                    let joined = py.detach(|| handle.join());
                    let result =
                        joined.map_err(|_| PyRuntimeError::new_err("rustbpe: the counting thread panicked"))?;
                    counts = Some(result.map_err(PyValueError::new_err)?);
                }
                if buffer.is_empty() {
                    return Ok(counts.take().unwrap_or_default());
                }
                n_texts += buffer.len();
                n_bytes += buffer.iter().map(|s| s.len()).sum::<usize>();
                let mut running = counts.take().unwrap_or_default();
                let splitter = &splitter;
                pending = Some(scope.spawn(move || {
                    count_into(&mut running, splitter, &buffer)?;
                    Ok(running)
                }));
                py.check_signals()?;
                if last_log.elapsed().as_secs_f64() >= 5.0 {
                    log(
                        py,
                        INFO,
                        &format!("counting: {n_texts} texts ({:.1} MB) so far", n_bytes as f64 / 1e6),
                    );
                    last_log = Instant::now();
                }
            }
        })?;
        let t_count = t0.elapsed().as_secs_f64();
        log(
            py,
            INFO,
            &format!(
                "counted {} unique chunks in {n_texts} texts ({:.1} MB) in {t_count:.2}s",
                chunk_counts.len(),
                n_bytes as f64 / 1e6
            ),
        );

        // Unique chunks -> byte-id words with their counts.
        let words = py.detach(|| Words::new(chunk_counts.into_iter().map(|(k, v)| (k.into_bytes(), v))));

        let num_merges = (vocab_size - 256) as usize;
        let t1 = Instant::now();
        // Every ~1% of the merges: take the GIL to honour Ctrl-C, and log progress if 5 s passed since the last log.
        let step = (num_merges / 100).max(1);
        let mut last_log = Instant::now();
        let merges = py.detach(|| {
            merge_loop(words, num_merges, |done, total, pair, count| {
                if done % step == 0 {
                    Python::attach(|py| {
                        if last_log.elapsed().as_secs_f64() >= 5.0 {
                            last_log = Instant::now();
                            log(
                                py,
                                INFO,
                                &format!(
                                    "merge {done}/{total} ({:.0}%): {pair:?} -> {} (count {count}), {:.1}s",
                                    100.0 * done as f64 / total as f64,
                                    255 + done,
                                    t1.elapsed().as_secs_f64()
                                ),
                            );
                        }
                        py.check_signals()
                    })?;
                }
                Ok(())
            })
        })?;
        if merges.len() < num_merges {
            log(
                py,
                WARNING,
                &format!(
                    "the text ran out of pairs after {} merges: vocab_size is {} instead of the {vocab_size} asked for \
                     (train on more text or ask for fewer tokens)",
                    merges.len(),
                    256 + merges.len()
                ),
            );
        }
        self.pattern = pattern;
        self.splitter = splitter;
        self.set_merges(merges);
        log(
            py,
            INFO,
            &format!(
                "trained {} merges in {:.2}s (counting {t_count:.2}s, merging {:.2}s)",
                self.merges.len(),
                t0.elapsed().as_secs_f64(),
                t1.elapsed().as_secs_f64()
            ),
        );
        Ok(())
    }

    /// The regex used to split text into chunks.
    fn get_pattern(&self) -> String {
        self.pattern.clone()
    }

    /// [(token bytes, rank)] for every non-special token: the 256 single bytes, then the merges in order.
    /// This is tiktoken's `mergeable_ranks` (as a list).
    fn get_mergeable_ranks<'py>(&self, py: Python<'py>) -> Vec<(Bound<'py, PyBytes>, u32)> {
        self.token_bytes
            .iter()
            .enumerate()
            .map(|(i, b)| (PyBytes::new(py, b), i as u32))
            .collect()
    }

    /// [(left_id, right_id)] merged into tokens 256, 257, ... in order.
    fn get_merges(&self) -> Vec<Pair> {
        self.merges.clone()
    }

    /// Number of tokens: 256 + number of merges.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Token ids of `text` (split with the pattern, then the merges applied to each chunk in rank order).
    fn encode(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        py.detach(|| self.encode_str(text)).map_err(PyValueError::new_err)
    }

    /// `encode` on every text, in parallel with the GIL released.
    fn batch_encode(&self, py: Python<'_>, texts: Vec<String>) -> PyResult<Vec<Vec<u32>>> {
        py.detach(|| {
            texts
                .par_iter()
                .map(|t| self.encode_str(t))
                .collect::<Result<Vec<_>, String>>()
        })
        .map_err(PyValueError::new_err)
    }

    /// Text of the token ids. Byte sequences that are not valid UTF-8 (e.g. ids that cut a multi-byte char)
    /// are decoded lossily: each invalid piece becomes U+FFFD, as `bytes.decode("utf-8", "replace")` does.
    fn decode(&self, ids: Vec<i64>) -> PyResult<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in &ids {
            if id < 0 || id as usize >= self.token_bytes.len() {
                return Err(PyValueError::new_err(format!(
                    "unknown token id {id}: this tokenizer has ids 0..{}",
                    self.token_bytes.len() - 1
                )));
            }
            bytes.extend_from_slice(&self.token_bytes[id as usize]);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn __repr__(&self) -> String {
        format!("rustbpe.Tokenizer(vocab_size={})", self.token_bytes.len())
    }
}

/// The chunks `text` is split into before BPE (default pattern when `pattern` is None).
/// `text` may also be a list of str: then a list of chunk lists comes back (the pattern is compiled once).
#[pyfunction]
#[pyo3(signature = (text, pattern = None))]
fn split_text<'py>(py: Python<'py>, text: &Bound<'py, PyAny>, pattern: Option<&str>) -> PyResult<Bound<'py, PyAny>> {
    let splitter = Splitter::new(pattern.unwrap_or(NANOCHAT_PATTERN)).map_err(PyValueError::new_err)?;
    let split_one = |t: &str| -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        splitter.split(t, |c| out.push(c.to_string()))?;
        Ok(out)
    };
    if let Ok(s) = text.cast::<PyString>() {
        let s = s.to_str()?;
        let chunks = py.detach(|| split_one(s)).map_err(PyValueError::new_err)?;
        return Ok(chunks.into_pyobject(py)?.into_any());
    }
    let texts: Vec<String> = text
        .extract()
        .map_err(|_| PyTypeError::new_err("split_text takes a str or a list of str"))?;
    let chunks = py
        .detach(|| texts.iter().map(|t| split_one(t)).collect::<Result<Vec<_>, String>>())
        .map_err(PyValueError::new_err)?;
    Ok(chunks.into_pyobject(py)?.into_any())
}

#[pymodule]
fn rustbpe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Tokenizer>()?;
    m.add_function(wrap_pyfunction!(split_text, m)?)?;
    m.add("DEFAULT_PATTERN", NANOCHAT_PATTERN)?;
    m.add("GPT4_PATTERN", GPT4_PATTERN)?;
    Ok(())
}
