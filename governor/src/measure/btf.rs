//! Field offsets of `struct task_struct` in the running kernel, read from
//! its BTF (`/sys/kernel/btf/vmlinux`).
//!
//! The eBPF programs read `prev`'s and `next`'s tid, state and
//! `se.sum_exec_runtime` straight from the tracepoint's typed task
//! pointers. The offsets differ between kernels, configurations and
//! architectures, so the object carries none: the agent resolves them here
//! and hands them to the loader as read-only globals, which the verifier
//! then knows as constants. One object runs on every kernel with BTF, on
//! x86_64 and aarch64, with no CO-RE relocations.
//!
//! Only the parts of the format this needs are read: the header, the type
//! section (to skip every kind correctly) and struct/union members.

use std::collections::HashMap;

/// Why the running kernel cannot give the offsets.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("cannot read the kernel's BTF at {path} (the eBPF backend needs CONFIG_DEBUG_INFO_BTF)")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the kernel's BTF is malformed: {detail}")]
    Malformed { detail: String },
    #[error("the kernel's BTF has no {what}")]
    Missing { what: String },
}

/// Byte offsets within `struct task_struct`, as the eBPF globals take them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskOffsets {
    /// `pid` (the tid, as the kernel calls it).
    pub pid: u32,
    /// `__state` (`TASK_DEAD` on a task's final switch).
    pub state: u32,
    /// `se.sum_exec_runtime`: the kernel's own count of the task's on-CPU
    /// ns, what schedstat, `CLOCK_THREAD_CPUTIME_ID` and `getrusage` report.
    pub sum_exec_runtime: u32,
    /// `se.exec_start`: the run queue's task clock when the kernel last
    /// brought the task's runtime up to date (at switch-in: its slice start).
    pub exec_start: u32,
    /// `tgid`: the process.
    pub tgid: u32,
    /// `se.prev_sum_exec_runtime`: the runtime when the current slice began.
    pub prev_sum_exec_runtime: u32,
    /// `nvcsw` and `nivcsw`: the task's switch counts.
    pub nvcsw: u32,
    /// See `nvcsw`.
    pub nivcsw: u32,
    /// `filename` of `struct linux_binprm` (not a task field: the path
    /// `sched_process_exec` reports).
    pub bprm_filename: u32,
    /// `sched_info.run_delay`: the task's total run-queue wait. `None` on a
    /// kernel without CONFIG_SCHED_INFO (waits are not measured there).
    pub run_delay: Option<u32>,
    /// `sched_info.last_queued`: when the task was queued to wait for a
    /// CPU (0: not waiting). `None` without CONFIG_SCHED_INFO.
    pub last_queued: Option<u32>,
}

const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

struct Member {
    name: u32,
    ty: u32,
    /// Bit offset within the enclosing type.
    bit_offset: u32,
}

struct Type {
    kind: u32,
    name: u32,
    /// Referenced type (typedef, const, volatile, ...).
    refers: u32,
    members: Vec<Member>,
}

/// The parsed type section and its strings.
pub struct Btf {
    types: Vec<Type>,
    strings: Vec<u8>,
    by_name: HashMap<(u32, String), u32>,
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn malformed(detail: impl Into<String>) -> BtfError {
    BtfError::Malformed { detail: detail.into() }
}

impl Btf {
    /// The running kernel's BTF.
    pub fn from_sys_fs() -> Result<Btf, BtfError> {
        let path = "/sys/kernel/btf/vmlinux";
        let data = std::fs::read(path).map_err(|source| BtfError::Read { path: path.into(), source })?;
        Btf::parse(&data)
    }

    /// Parses a little-endian BTF blob (both supported architectures are).
    pub fn parse(data: &[u8]) -> Result<Btf, BtfError> {
        if data.get(0..2) != Some(&[0x9f, 0xeb]) {
            return Err(malformed("bad magic (not little-endian BTF)"));
        }
        let h = |at| le32(data, at).ok_or_else(|| malformed("short header"));
        let (hdr_len, type_off, type_len, str_off, str_len) = (h(4)?, h(8)?, h(12)?, h(16)?, h(20)?);
        let section = |off: u32, len: u32| {
            let start = hdr_len as usize + off as usize;
            data.get(start..start + len as usize).ok_or_else(|| malformed("section beyond the blob"))
        };
        let tsec = section(type_off, type_len)?;
        let strings = section(str_off, str_len)?.to_vec();
        // Type ids start at 1; id 0 is void.
        let mut types = vec![Type { kind: 0, name: 0, refers: 0, members: Vec::new() }];
        let mut at = 0usize;
        while at < tsec.len() {
            let word = |i: usize| le32(tsec, at + 4 * i).ok_or_else(|| malformed("truncated type"));
            let (name, info, size_or_type) = (word(0)?, word(1)?, word(2)?);
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let kind_flag = info >> 31 == 1;
            at += 12;
            let mut members = Vec::new();
            let extra = match kind {
                1 | 14 | 17 => 4, // int, var, decl_tag
                3 => 12,          // array
                4 | 5 => {
                    for m in 0..vlen {
                        let w = |i: usize| le32(tsec, at + 12 * m + 4 * i).ok_or_else(|| malformed("truncated member"));
                        let raw = w(2)?;
                        // With kind_flag the high 8 bits are a bitfield size.
                        let bit_offset = if kind_flag { raw & 0x00ff_ffff } else { raw };
                        members.push(Member { name: w(0)?, ty: w(1)?, bit_offset });
                    }
                    12 * vlen
                }
                6 | 13 => 8 * vlen,   // enum, func_proto
                15 | 19 => 12 * vlen, // datasec, enum64
                2 | 7 | 8 | 9 | 10 | 11 | 12 | 16 | 18 => 0,
                other => return Err(malformed(format!("unknown type kind {other}"))),
            };
            at += extra;
            types.push(Type { kind, name, refers: size_or_type, members });
        }
        let mut btf = Btf { types, strings, by_name: HashMap::new() };
        for (id, t) in btf.types.iter().enumerate().skip(1) {
            if matches!(t.kind, KIND_STRUCT | KIND_UNION) && t.name != 0 {
                let name = btf.string(t.name).to_string();
                btf.by_name.entry((t.kind, name)).or_insert(id as u32);
            }
        }
        Ok(btf)
    }

    fn string(&self, off: u32) -> &str {
        let tail = self.strings.get(off as usize..).unwrap_or(&[]);
        let end = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
        std::str::from_utf8(&tail[..end]).unwrap_or("")
    }

    /// Follows typedefs and qualifiers to the struct or union underneath.
    fn resolve(&self, mut id: u32) -> Option<&Type> {
        for _ in 0..32 {
            let t = self.types.get(id as usize)?;
            match t.kind {
                KIND_STRUCT | KIND_UNION => return Some(t),
                8..=11 | 18 => id = t.refers, // typedef, volatile, const, restrict, type_tag
                _ => return None,
            }
        }
        None
    }

    /// Bit offset of member `name` in `t`, looking through anonymous
    /// structs and unions; with the member's type id.
    fn member(&self, t: &Type, name: &str, depth: u32) -> Option<(u32, u32)> {
        if depth > 8 {
            return None;
        }
        for m in &t.members {
            if m.name != 0 && self.string(m.name) == name {
                return Some((m.bit_offset, m.ty));
            }
        }
        for m in t.members.iter().filter(|m| m.name == 0) {
            if let Some(inner) = self.resolve(m.ty)
                && let Some((off, ty)) = self.member(inner, name, depth + 1)
            {
                return Some((m.bit_offset + off, ty));
            }
        }
        None
    }

    /// Byte offset of a dotted member path (`"se.sum_exec_runtime"`) in
    /// struct `root`.
    pub fn offset_of(&self, root: &str, path: &str) -> Result<u32, BtfError> {
        let missing = || BtfError::Missing { what: format!("struct {root} member {path}") };
        let id = *self
            .by_name
            .get(&(KIND_STRUCT, root.to_string()))
            .ok_or_else(|| BtfError::Missing { what: format!("struct {root}") })?;
        let mut t = self.resolve(id).ok_or_else(missing)?;
        let mut bits = 0u32;
        let parts: Vec<&str> = path.split('.').collect();
        for (i, part) in parts.iter().enumerate() {
            let (off, ty) = self.member(t, part, 0).ok_or_else(missing)?;
            bits += off;
            if i + 1 < parts.len() {
                t = self.resolve(ty).ok_or_else(missing)?;
            }
        }
        if !bits.is_multiple_of(8) {
            return Err(malformed(format!("{root}.{path} is a bitfield")));
        }
        Ok(bits / 8)
    }

    /// The `task_struct` offsets the eBPF programs need.
    pub fn task_offsets(&self) -> Result<TaskOffsets, BtfError> {
        Ok(TaskOffsets {
            pid: self.offset_of("task_struct", "pid")?,
            state: self.offset_of("task_struct", "__state")?,
            sum_exec_runtime: self.offset_of("task_struct", "se.sum_exec_runtime")?,
            exec_start: self.offset_of("task_struct", "se.exec_start")?,
            tgid: self.offset_of("task_struct", "tgid")?,
            prev_sum_exec_runtime: self.offset_of("task_struct", "se.prev_sum_exec_runtime")?,
            nvcsw: self.offset_of("task_struct", "nvcsw")?,
            nivcsw: self.offset_of("task_struct", "nivcsw")?,
            bprm_filename: self.offset_of("linux_binprm", "filename")?,
            run_delay: self.offset_of("task_struct", "sched_info.run_delay").ok(),
            last_queued: self.offset_of("task_struct", "sched_info.last_queued").ok(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built blob: `struct inner { u64 a; u64 b; }` and
    /// `struct outer { u32 x; union { u32 y; }; struct inner in; }`.
    fn blob() -> Vec<u8> {
        let strings = b"\0inner\0a\0b\0outer\0x\0y\0in\0u64\0u32\0".to_vec();
        let s = |name: &str| {
            let pos = strings
                .windows(name.len() + 2)
                .position(|w| w[0] == 0 && &w[1..=name.len()] == name.as_bytes() && w[name.len() + 1] == 0);
            pos.map(|p| p as u32 + 1).unwrap()
        };
        let mut t = Vec::new();
        let mut push = |words: &[u32]| words.iter().for_each(|w| t.extend_from_slice(&w.to_le_bytes()));
        // 1: int u64
        push(&[s("u64"), 1 << 24, 8, 64]);
        // 2: int u32
        push(&[s("u32"), 1 << 24, 4, 32]);
        // 3: struct inner, 2 members
        push(&[s("inner"), 4 << 24 | 2, 16, s("a"), 1, 0, s("b"), 1, 64]);
        // 4: anonymous union { u32 y }
        push(&[0, 5 << 24 | 1, 4, s("y"), 2, 0]);
        // 5: struct outer { x @0, anon union @32, in @64 }
        push(&[s("outer"), 4 << 24 | 3, 24, s("x"), 2, 0, 0, 4, 32, s("in"), 3, 64]);
        let mut b = vec![0x9f, 0xeb, 1, 0];
        for w in [24u32, 0, t.len() as u32, t.len() as u32, strings.len() as u32] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(&t);
        b.extend_from_slice(&strings);
        b
    }

    #[test]
    fn nested_and_anonymous_members_resolve() {
        let btf = Btf::parse(&blob()).unwrap();
        assert_eq!(btf.offset_of("outer", "x").unwrap(), 0);
        assert_eq!(btf.offset_of("outer", "y").unwrap(), 4);
        assert_eq!(btf.offset_of("outer", "in.b").unwrap(), 16);
        assert!(matches!(btf.offset_of("outer", "nope"), Err(BtfError::Missing { .. })));
        assert!(matches!(btf.offset_of("absent", "x"), Err(BtfError::Missing { .. })));
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        assert!(matches!(Btf::parse(b"hello"), Err(BtfError::Malformed { .. })));
        let mut b = blob();
        b.truncate(40);
        assert!(Btf::parse(&b).is_err());
    }

    #[test]
    fn this_kernel_has_the_task_fields() {
        // Every kernel this project supports exposes BTF; skip where the
        // test runs without it (a build container).
        let Ok(btf) = Btf::from_sys_fs() else { return };
        let o = btf.task_offsets().unwrap();
        let all = [o.pid, o.state, o.sum_exec_runtime, o.exec_start];
        assert!(all.iter().enumerate().all(|(i, a)| all[i + 1..].iter().all(|b| a != b)), "{o:?}");
        assert!(o.sum_exec_runtime > 0 && o.sum_exec_runtime % 8 == 0, "{o:?}");
    }
}
