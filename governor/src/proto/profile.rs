//! What `governor profile` answers: samples of tagged work by keyspace,
//! with their stacks symbolized.

use serde::{Deserialize, Serialize};

/// A profile: the samples the kernel took of tagged work, by keyspace, with
/// their stacks symbolized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileReport {
    /// How long it sampled.
    pub seconds: f64,
    pub frequency_hz: u32,
    /// Online CPUs sampled.
    pub cpus: u32,
    /// Samples and charged CPU by keyspace, most samples first.
    pub keyspaces: Vec<ProfileKeyspace>,
    /// Every distinct stack with its samples.
    pub stacks: Vec<ProfileStack>,
    /// Samples whose user or kernel stack was walked but not kept (the
    /// stack table full, or the walk failed): counted, with `[lost]` frames.
    pub lost_stacks: u64,
    /// Samples of tagged work counted under no key: the kernel's table of
    /// (keyspace, process, stacks) was full (16 384 keys). Not in
    /// `keyspaces` or `stacks`.
    #[serde(default)]
    pub dropped_samples: u64,
}

/// One keyspace's share of a profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileKeyspace {
    pub keyspace_id: u32,
    pub samples: u64,
    /// CPU charged to the keyspace while the profile ran.
    pub cpu_seconds: f64,
}

/// A stack, root first: the process's name, its user frames, then its
/// kernel frames (suffixed `_[k]`, as flame graph tools mark them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileStack {
    pub keyspace_id: u32,
    /// The request kind the work was tagged with (`Demand::kind`,
    /// `client::tag_with_kind`); 0: none given.
    #[serde(default)]
    pub kind: u8,
    pub pid: u32,
    pub frames: Vec<String>,
    pub samples: u64,
}
