//! The record of what the agent changes in the cgroup hierarchy (the state
//! file beside its socket), when it is lost or cannot be written: no process
//! is left capped with nobody to put it back.

use governor_tests::{Agent, Reap, Scratch, cpu_cgroup, cpu_hierarchy, eventually, governor_bin, output_text as text};
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The name the agent on `socket` gives its keyspace cgroups (FNV-1a of
/// the path, as the agent derives it).
fn prefix_of(socket: &Path) -> String {
    let h = socket
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193));
    format!("governor-{h:08x}")
}

/// A program named `name` (a copy of sleep) sleeping a minute.
fn sleeper(scratch: &Scratch, name: &str) -> Reap {
    let exe = scratch.0.join(name);
    std::fs::copy("/bin/sleep", &exe).unwrap();
    Reap(Command::new(&exe).arg("60").spawn().unwrap())
}

#[test]
fn cgroups_of_the_agents_name_that_no_record_names_are_removed_at_start() {
    let _s = serial();
    let scratch = Scratch::new("crash-record-sweep");
    let socket = scratch.0.join("g.sock");
    // What an agent that died with its record lost left: its keyspace
    // cgroup, capped, with a process inside; an empty record.
    let left = cpu_hierarchy().join(format!("{}-ks-999", prefix_of(&socket)));
    std::fs::create_dir_all(&left).unwrap();
    let sleep = sleeper(&scratch, "govtest-left");
    let pid = sleep.0.id();
    let before = cpu_cgroup(pid).unwrap();
    std::fs::write(left.join("cgroup.procs"), pid.to_string()).unwrap();
    std::fs::write(socket.with_file_name("g.sock.cgroups.json"), "").unwrap();
    // Another agent's cgroup of the same kind is not this one's to remove.
    let other = cpu_hierarchy().join("governor-0badf00d-ks-999");
    std::fs::create_dir_all(&other).unwrap();
    let agent = Agent::start_on("ebpf", "", &socket).unwrap();
    let log = agent.log_text();
    assert!(!left.exists(), "{} still there; log: {log}", left.display());
    assert_eq!(cpu_cgroup(pid).as_deref(), Some("/"), "the process goes to the root (it was in {before})");
    assert!(log.contains("that no record names"), "{log}");
    assert!(other.exists(), "another agent's cgroup was removed");
    std::fs::remove_dir(&other).unwrap();
    drop(agent);
}

/// A small tmpfs at `dir`, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: std::path::PathBuf) -> Tmpfs {
        std::fs::create_dir_all(&dir).unwrap();
        let mounted =
            Command::new("mount").args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"]).arg(&dir).status().unwrap();
        assert!(mounted.success(), "mount a tmpfs on {}", dir.display());
        Tmpfs(dir)
    }

    /// Leaves no room on it.
    fn fill(&self) {
        let _ =
            Command::new("dd").arg("if=/dev/zero").arg(format!("of={}/fill", self.0.display())).arg("bs=4k").output();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// `rules list --json` of the agent on `socket`.
fn rules_list(socket: &Path) -> serde_json::Value {
    let o = Command::new(governor_bin()).args(["rules", "list", "--json", "--socket"]).arg(socket).output().unwrap();
    serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", text(&o)))
}

#[test]
fn a_record_that_cannot_be_written_stops_the_caps_and_moves_nothing() {
    let _s = serial();
    let scratch = Scratch::new("crash-record-full");
    // The socket's directory on a file system with no room left.
    let run = Tmpfs::mount(scratch.0.join("run"));
    run.fill();
    let socket = run.0.join("g.sock");
    let sleep = sleeper(&scratch, "govtest-nospace");
    let pid = sleep.0.id();
    let before = cpu_cgroup(pid).unwrap();
    let config = "[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = \"998:500\"\n\n\
                  [[rules]]\nname = \"nospace\"\nkeyspace = 998\ncomm-prefix = \"govtest-nospac\"\n";
    let agent = Agent::start_on("ebpf", config, &socket).unwrap();
    eventually("the rule matched its process", || {
        rules_list(&socket)["rules"][0]["processes_matched"].as_u64() == Some(1)
    });
    let l = rules_list(&socket);
    let how = l["enforcement"].as_str().unwrap_or_default();
    eprintln!("with no room for the record: {how}");
    assert!(how.starts_with("unavailable") && how.contains("cannot write the state file"), "{l}");
    assert_eq!(cpu_cgroup(pid), Some(before), "moved without a record");
    let made = cpu_hierarchy().join(format!("{}-ks-998", prefix_of(&socket)));
    assert!(!made.exists(), "{} made without a record", made.display());
    // doctor warns: rules in force, caps not enforced.
    let o = Command::new(governor_bin()).args(["doctor", "--json", "--socket"]).arg(&socket).output().unwrap();
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", text(&o)));
    let caps = d["checks"].as_array().unwrap().iter().find(|c| c["check"] == "rule-caps").cloned().unwrap_or_default();
    assert_eq!(caps["status"], "warn", "{d:#}");
    // So does the text status.
    let o = Command::new(governor_bin()).args(["status", "--socket"]).arg(&socket).output().unwrap();
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("rules        1 in force; caps unavailable") && said.contains("cannot write the state file"),
        "{said}"
    );
    drop(agent);
}

/// The disk fills once a keyspace's cgroup is there: the next move cannot
/// be recorded, so everything is put back at once from what the agent
/// knows, and the caps stop.
#[test]
fn a_record_that_stops_being_written_puts_everything_back() {
    let _s = serial();
    let scratch = Scratch::new("crash-record-fills");
    let run = Tmpfs::mount(scratch.0.join("run"));
    let socket = run.0.join("g.sock");
    let config = "[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = \"996:500\"\n\n\
                  [[rules]]\nname = \"fills\"\nkeyspace = 996\ncomm-prefix = \"govtest-fills\"\n";
    let first = sleeper(&scratch, "govtest-fills");
    let before = cpu_cgroup(first.0.id()).unwrap();
    let agent = Agent::start_on("ebpf", config, &socket).unwrap();
    eventually("moved into its cgroup", || cpu_cgroup(first.0.id()).is_some_and(|c| c.ends_with("-ks-996")));
    run.fill();
    let second = Reap(Command::new(scratch.0.join("govtest-fills")).arg("60").spawn().unwrap());
    eventually("the caps stopped", || {
        rules_list(&socket)["enforcement"].as_str().unwrap_or_default().contains("cannot write the state file")
    });
    for p in [first.0.id(), second.0.id()] {
        assert_eq!(cpu_cgroup(p), Some(before.clone()), "process {p} not put back");
    }
    let made = cpu_hierarchy().join(format!("{}-ks-996", prefix_of(&socket)));
    assert!(!made.exists(), "{} still there", made.display());
    drop(agent);
}

/// A FIFO where the record should be: the start reads no record (said in
/// the log) and does not wait for a writer.
#[test]
fn a_fifo_in_the_records_place_does_not_hang_the_start() {
    let _s = serial();
    let scratch = Scratch::new("crash-record-fifo");
    let socket = scratch.0.join("g.sock");
    assert!(Command::new("mkfifo").arg(scratch.0.join("g.sock.cgroups.json")).status().unwrap().success());
    let agent = Agent::start_on("ebpf", "", &socket).unwrap();
    let log = agent.log_text();
    assert!(log.contains("a FIFO, not a state file"), "{log}");
    drop(agent);
}

/// A process found in another agent's keyspace cgroup (an agent on another
/// socket whose rules match it too, or one that died there): taken, said in
/// the log, and put back to the root, never into that cgroup, whose cap
/// would hold it with nobody to lift it.
#[test]
fn a_process_taken_from_another_agents_cgroup_is_put_back_to_the_root() {
    let _s = serial();
    let scratch = Scratch::new("crash-record-other");
    let other = cpu_hierarchy().join("governor-0badf00d-ks-997");
    std::fs::create_dir_all(&other).unwrap();
    let sleep = sleeper(&scratch, "govtest-other");
    let pid = sleep.0.id();
    std::fs::write(other.join("cgroup.procs"), pid.to_string()).unwrap();
    let config = "[resource-control.cpu-throttle]\nenabled = true\nkeyspace-cpu-quotas = \"997:500\"\n\n\
                  [[rules]]\nname = \"other\"\nkeyspace = 997\ncomm-prefix = \"govtest-other\"\n";
    let mut agent = Agent::start("ebpf", config).unwrap();
    eventually("moved into this agent's cgroup", || {
        cpu_cgroup(pid).is_some_and(|c| c.ends_with("-ks-997") && !c.contains("0badf00d"))
    });
    let log = agent.log_text();
    assert!(log.contains("another governor agent's keyspace cgroup"), "{log}");
    agent.restart_with_config("").unwrap();
    assert_eq!(cpu_cgroup(pid).as_deref(), Some("/"), "put back into the other agent's cgroup");
    drop(agent);
    std::fs::remove_dir(&other).unwrap();
}
