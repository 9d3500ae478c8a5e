//! What the server holds for each keyspace, and the CPU work of reading it.
//!
//! A keyspace is one sorted run of rows kept the way an LSM engine keeps an
//! SST file: entries with prefix-compressed keys in blocks of about 32 KiB,
//! each block LZ4-compressed and covered by a CRC32 of its stored bytes, and
//! an index of each block's first row. Reading is real work on real bytes:
//! a point get opens one block (checksum, decompress, walk the entries to
//! the key, decode the row: tens of µs); a scan opens block after block,
//! decodes and filters every row, aggregates the matches and encodes them
//! into LZ4-compressed response chunks (hundreds of µs to milliseconds),
//! in steps of a few blocks so a server can yield between them.

/// Uncompressed size a block is cut at.
const BLOCK_BYTES: usize = 32 * 1024;
/// A scan compresses its response every this many bytes.
const RESPONSE_CHUNK_BYTES: usize = 16 * 1024;
/// Row status codes; a scan keeps rows with [`STATUS_SHIPPED`].
pub const STATUS_SHIPPED: u8 = 2;
const STATUSES: u8 = 4;
const WORDS: &[&str] = &[
    "pallet",
    "invoice",
    "express",
    "fragile",
    "warehouse",
    "customs",
    "returned",
    "priority",
    "standard",
    "delivery",
    "window",
    "morning",
    "evening",
    "signature",
    "required",
    "contact",
    "reception",
    "loading",
    "dock",
    "north",
    "south",
    "east",
    "west",
    "gate",
    "floor",
    "second",
    "third",
    "ground",
    "refrigerated",
];

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("block {block} of keyspace {keyspace}: checksum {found:#010x}, expected {expected:#010x}")]
    Checksum { keyspace: u32, block: usize, found: u32, expected: u32 },
    #[error("block {block} of keyspace {keyspace} does not decompress")]
    Decompress {
        keyspace: u32,
        block: usize,
        #[source]
        source: lz4_flex::block::DecompressError,
    },
    #[error("malformed {what} in keyspace {keyspace}")]
    Malformed { keyspace: u32, what: &'static str },
}

/// splitmix64: the generator of every keyspace's rows (a keyspace's data
/// depends only on its id and size).
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// One decoded row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row<'a> {
    pub id: u64,
    pub amount: u64,
    pub status: u8,
    pub region: u16,
    pub comment: &'a str,
}

/// The key of `row` in `keyspace`: fixed width, so keys sort as rows do.
pub fn key_of(keyspace: u32, row: u64) -> Vec<u8> {
    format!("t{keyspace:08}_r{row:012}").into_bytes()
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A varint at the front of `buf`, and the rest.
fn take_varint(buf: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, b) in buf.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, &buf[i + 1..]));
        }
    }
    None
}

fn take_bytes(buf: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
    (buf.len() >= n).then(|| buf.split_at(n))
}

fn encode_row(out: &mut Vec<u8>, id: u64, amount: u64, status: u8, region: u16, comment: &str) {
    put_varint(out, id);
    put_varint(out, amount);
    out.push(status);
    out.extend_from_slice(&region.to_le_bytes());
    put_varint(out, comment.len() as u64);
    out.extend_from_slice(comment.as_bytes());
}

/// Decodes a row value (the comment is checked to be UTF-8).
pub fn decode_row(v: &[u8]) -> Option<Row<'_>> {
    let (id, v) = take_varint(v)?;
    let (amount, v) = take_varint(v)?;
    let (&status, v) = v.split_first()?;
    let (region, v) = take_bytes(v, 2)?;
    let (len, v) = take_varint(v)?;
    let (comment, _) = take_bytes(v, len as usize)?;
    Some(Row {
        id,
        amount,
        status,
        region: u16::from_le_bytes([region[0], region[1]]),
        comment: std::str::from_utf8(comment).ok()?,
    })
}

/// A stored block: its first row, and its compressed bytes with their CRC.
struct Block {
    first_row: u64,
    stored: Vec<u8>,
    crc: u32,
}

/// Entries of an opened block: `(key, value)`, keys rebuilt from their
/// shared prefix with the previous key.
struct Entries<'a> {
    rest: &'a [u8],
    key: Vec<u8>,
}

impl<'a> Entries<'a> {
    fn new(data: &'a [u8]) -> Entries<'a> {
        Entries { rest: data, key: Vec::with_capacity(32) }
    }

    /// The next entry; `Some(None)` on a malformed one.
    fn next_entry(&mut self) -> Option<Option<(&[u8], &'a [u8])>> {
        if self.rest.is_empty() {
            return None;
        }
        let parsed = (|| {
            let (shared, r) = take_varint(self.rest)?;
            let (unshared, r) = take_varint(r)?;
            let (vlen, r) = take_varint(r)?;
            let (suffix, r) = take_bytes(r, unshared as usize)?;
            let (value, r) = take_bytes(r, vlen as usize)?;
            Some((shared as usize, suffix, value, r))
        })();
        let Some((shared, suffix, value, rest)) = parsed else {
            self.rest = &[];
            return Some(None);
        };
        if shared > self.key.len() {
            self.rest = &[];
            return Some(None);
        }
        self.key.truncate(shared);
        self.key.extend_from_slice(suffix);
        self.rest = rest;
        Some(Some((&self.key, value)))
    }
}

/// One keyspace's rows `0..rows`.
pub struct KeyspaceData {
    pub id: u32,
    pub rows: u64,
    blocks: Vec<Block>,
    /// Uncompressed bytes of all blocks.
    pub raw_bytes: usize,
}

impl KeyspaceData {
    /// Generates `rows` rows for keyspace `id` (deterministic in both).
    pub fn generate(id: u32, rows: u64) -> KeyspaceData {
        let mut rng = SplitMix(0x5EED_0000 ^ u64::from(id) << 32);
        let mut blocks = Vec::new();
        let (mut raw, mut value, mut comment) = (Vec::with_capacity(BLOCK_BYTES + 1024), Vec::new(), String::new());
        let mut prev_key: Vec<u8> = Vec::new();
        let mut first_row = 0;
        let mut raw_bytes = 0;
        for row in 0..rows {
            comment.clear();
            let words = 16 + rng.below(24);
            for _ in 0..words {
                comment.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
                comment.push(' ');
            }
            comment.push_str(&format!("#{}", rng.below(1_000_000)));
            value.clear();
            let status = rng.below(u64::from(STATUSES)) as u8;
            encode_row(&mut value, row, rng.below(100_000), status, rng.below(64) as u16, &comment);
            let key = key_of(id, row);
            let shared = prev_key.iter().zip(&key).take_while(|(a, b)| a == b).count();
            put_varint(&mut raw, shared as u64);
            put_varint(&mut raw, (key.len() - shared) as u64);
            put_varint(&mut raw, value.len() as u64);
            raw.extend_from_slice(&key[shared..]);
            raw.extend_from_slice(&value);
            prev_key = key;
            if raw.len() >= BLOCK_BYTES || row + 1 == rows {
                raw_bytes += raw.len();
                let stored = lz4_flex::block::compress_prepend_size(&raw);
                let crc = crc32fast::hash(&stored);
                blocks.push(Block { first_row, stored, crc });
                raw.clear();
                prev_key.clear();
                first_row = row + 1;
            }
        }
        KeyspaceData { id, rows, blocks, raw_bytes }
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Stored (compressed) bytes.
    pub fn stored_bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.stored.len()).sum()
    }

    /// Rows per block, on average.
    pub fn rows_per_block(&self) -> f64 {
        self.rows as f64 / self.blocks.len().max(1) as f64
    }

    /// Blocks a scan of `count` rows opens (at most all of them).
    pub fn blocks_for_scan(&self, count: u64) -> u64 {
        let per_block = self.rows_per_block().max(1.0);
        ((count as f64 / per_block).ceil() as u64 + 1).min(self.blocks.len() as u64)
    }

    /// The block holding `row` (index binary search).
    fn block_of(&self, row: u64) -> usize {
        self.blocks.partition_point(|b| b.first_row <= row).saturating_sub(1)
    }

    /// Checks block `i`'s checksum and decompresses it.
    fn open(&self, i: usize) -> Result<Vec<u8>, StoreError> {
        let b = &self.blocks[i];
        let found = crc32fast::hash(&b.stored);
        if found != b.crc {
            return Err(StoreError::Checksum { keyspace: self.id, block: i, found, expected: b.crc });
        }
        lz4_flex::block::decompress_size_prepended(&b.stored).map_err(|source| StoreError::Decompress {
            keyspace: self.id,
            block: i,
            source,
        })
    }

    fn malformed(&self, what: &'static str) -> StoreError {
        StoreError::Malformed { keyspace: self.id, what }
    }

    /// Point get: the encoded row `row % rows`, after decoding it.
    pub fn get(&self, row: u64) -> Result<Vec<u8>, StoreError> {
        let row = row % self.rows.max(1);
        let data = self.open(self.block_of(row))?;
        let key = key_of(self.id, row);
        let mut entries = Entries::new(&data);
        while let Some(e) = entries.next_entry() {
            let (k, v) = e.ok_or_else(|| self.malformed("block entry"))?;
            if k == key.as_slice() {
                decode_row(v).ok_or_else(|| self.malformed("row"))?;
                return Ok(v.to_vec());
            }
        }
        Err(self.malformed("index (row not in its block)"))
    }
}

/// What reading costs on this machine, measured by the thread's CPU clock:
/// µs per point get and per block a scan reads. A server states a
/// request's expected CPU from it when asking for admission.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    pub get_us: f64,
    pub scan_block_us: f64,
}

impl CostModel {
    /// Times `gets` point gets and one pass of a scan over every block of
    /// `ks`, with `cpu_ns` as the clock.
    pub fn measure(ks: &KeyspaceData, gets: u64, cpu_ns: impl Fn() -> u64) -> Result<CostModel, StoreError> {
        let mut rng = SplitMix(42);
        let t0 = cpu_ns();
        for _ in 0..gets {
            std::hint::black_box(ks.get(rng.next_u64())?);
        }
        let t1 = cpu_ns();
        let mut scan = Scan::new(ks, 0, ks.rows);
        while !scan.step(ks, usize::MAX)? {}
        let t2 = cpu_ns();
        Ok(CostModel {
            get_us: (t1 - t0) as f64 / 1e3 / gets.max(1) as f64,
            scan_block_us: (t2 - t1) as f64 / 1e3 / ks.blocks().max(1) as f64,
        })
    }

    /// Expected CPU of a scan of `count` rows of `ks`, µs.
    pub fn scan_us(&self, ks: &KeyspaceData, count: u64) -> f64 {
        ks.blocks_for_scan(count) as f64 * self.scan_block_us
    }
}

/// What a scan returns: aggregates over the rows it read, and the size and
/// checksum of the compressed response chunks it encoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanSummary {
    pub rows: u64,
    pub matched: u64,
    pub amount_sum: u64,
    pub response_bytes: u64,
    pub compressed_bytes: u64,
    pub checksum: u32,
}

/// A scan of `count` rows from `start` (wrapping at the end of the
/// keyspace), run a few blocks at a time with [`Scan::step`].
pub struct Scan {
    next_row: u64,
    remaining: u64,
    out: Vec<u8>,
    hasher: crc32fast::Hasher,
    summary: ScanSummary,
}

impl Scan {
    pub fn new(ks: &KeyspaceData, start: u64, count: u64) -> Scan {
        Scan {
            next_row: start % ks.rows.max(1),
            remaining: count.min(ks.rows),
            out: Vec::with_capacity(RESPONSE_CHUNK_BYTES + 512),
            hasher: crc32fast::Hasher::new(),
            summary: ScanSummary::default(),
        }
    }

    pub fn done(&self) -> bool {
        self.remaining == 0
    }

    /// Reads at most `max_blocks` more blocks; `true` when the scan is over.
    pub fn step(&mut self, ks: &KeyspaceData, max_blocks: usize) -> Result<bool, StoreError> {
        for _ in 0..max_blocks.max(1) {
            if self.remaining == 0 {
                break;
            }
            let i = ks.block_of(self.next_row);
            let data = ks.open(i)?;
            let mut entries = Entries::new(&data);
            let mut last = None;
            while let Some(e) = entries.next_entry() {
                let (_, v) = e.ok_or_else(|| ks.malformed("block entry"))?;
                let row = decode_row(v).ok_or_else(|| ks.malformed("row"))?;
                last = Some(row.id);
                if row.id < self.next_row || self.remaining == 0 {
                    continue;
                }
                self.remaining -= 1;
                self.summary.rows += 1;
                if row.status == STATUS_SHIPPED {
                    self.summary.matched += 1;
                    self.summary.amount_sum += row.amount;
                    encode_row(&mut self.out, row.id, row.amount, row.status, row.region, row.comment);
                    if self.out.len() >= RESPONSE_CHUNK_BYTES {
                        self.flush();
                    }
                }
            }
            let last = last.ok_or_else(|| ks.malformed("empty block"))?;
            self.next_row = if last + 1 >= ks.rows { 0 } else { last + 1 };
        }
        if self.remaining == 0 {
            self.flush();
        }
        Ok(self.remaining == 0)
    }

    /// Compresses the response bytes gathered so far into one chunk.
    fn flush(&mut self) {
        if self.out.is_empty() {
            return;
        }
        let chunk = lz4_flex::block::compress_prepend_size(&self.out);
        self.hasher.update(&chunk);
        self.summary.response_bytes += self.out.len() as u64;
        self.summary.compressed_bytes += chunk.len() as u64;
        self.out.clear();
    }

    pub fn summary(&self) -> ScanSummary {
        ScanSummary { checksum: self.hasher.clone().finalize(), ..self.summary }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_get_finds_every_row_it_is_asked_for() {
        let ks = KeyspaceData::generate(7, 3000);
        assert!(ks.blocks() > 10, "{} blocks", ks.blocks());
        for row in [0, 1, 63, 64, 1500, 2999, 3000 + 5] {
            let v = ks.get(row).unwrap();
            assert_eq!(decode_row(&v).unwrap().id, row % 3000);
        }
    }

    #[test]
    fn a_scan_reads_exactly_its_rows_and_wraps_around() {
        let ks = KeyspaceData::generate(8, 2000);
        let mut s = Scan::new(&ks, 1900, 300);
        let mut steps = 0;
        while !s.step(&ks, 1).unwrap() {
            steps += 1;
        }
        let sum = s.summary();
        assert_eq!(sum.rows, 300);
        assert!(steps >= 2, "{steps} steps");
        // About a quarter of the rows match, and the response compresses.
        assert!((40..=110).contains(&sum.matched), "{sum:?}");
        assert!(sum.compressed_bytes > 0 && sum.compressed_bytes < sum.response_bytes, "{sum:?}");
        // The same scan gives the same answer.
        let mut again = Scan::new(&ks, 1900, 300);
        while !again.step(&ks, 100).unwrap() {}
        assert_eq!(again.summary(), sum);
    }

    #[test]
    fn a_corrupt_block_is_refused_by_its_checksum() {
        let mut ks = KeyspaceData::generate(9, 500);
        ks.blocks[0].stored[10] ^= 0xff;
        assert!(matches!(ks.get(0), Err(StoreError::Checksum { .. })));
    }

    #[test]
    fn varints_round_trip() {
        for v in [0u64, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            assert_eq!(take_varint(&b), Some((v, &[][..])));
        }
    }
}
