//! The `.deb` that `cargo xtask dist` builds (and `cargo xtask test` builds
//! before the tests) installs with `dpkg -i`, puts the agent, its unit and
//! its configuration where the unit expects them, creates the `governor`
//! user, and the installed `governor doctor --json` runs; then it is purged.

use std::path::PathBuf;
use std::process::Command;

fn deb() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("target/dist");
    let name = format!("governor_{}_amd64.deb", env!("CARGO_PKG_VERSION"));
    dir.join(name)
}

fn text(o: &std::process::Output) -> String {
    format!("exit {:?}\n{}{}", o.status.code(), String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn the_deb_installs_and_the_installed_doctor_runs() {
    if std::env::consts::ARCH != "x86_64" {
        eprintln!("the amd64 package installs on x86_64 only");
        return;
    }
    let deb = deb();
    assert!(deb.exists(), "{} is missing: run `cargo xtask dist --arch x86_64` (cargo xtask test does)", deb.display());
    if std::path::Path::new("/usr/bin/governor").exists()
        && Command::new("dpkg").args(["-s", "governor"]).output().unwrap().status.success()
    {
        let _ = Command::new("dpkg").args(["--purge", "governor"]).output();
    }
    let o = Command::new("dpkg").arg("-i").arg(&deb).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let purge = || Command::new("dpkg").args(["--purge", "governor"]).output().unwrap();
    let check = || -> Result<(), String> {
        for f in ["/usr/bin/governor", "/lib/systemd/system/governor.service", "/etc/governor/governor.toml"] {
            if !std::path::Path::new(f).exists() {
                return Err(format!("{f} not installed"));
            }
        }
        let user = Command::new("getent").args(["passwd", "governor"]).output().unwrap();
        if !user.status.success() {
            return Err("no governor user".into());
        }
        let v = Command::new("/usr/bin/governor")
            .args(["config", "validate", "/etc/governor/governor.toml"])
            .output()
            .unwrap();
        if !v.status.success() {
            return Err(format!("the installed configuration: {}", text(&v)));
        }
        let d = Command::new("/usr/bin/governor")
            .args(["doctor", "--json", "--socket", "/run/governor-package-test/none.sock"])
            .output()
            .unwrap();
        let r: serde_json::Value =
            serde_json::from_slice(&d.stdout).map_err(|e| format!("doctor --json: {e}: {}", text(&d)))?;
        // Root here: the eBPF backend can run (exit 0); the agent is not running (a warning).
        if d.status.code() != Some(0) || r["ebpf_backend"] != true {
            return Err(format!("doctor: {}", text(&d)));
        }
        Ok(())
    };
    let result = check();
    let p = purge();
    result.unwrap();
    assert!(p.status.success(), "{}", text(&p));
    assert!(!std::path::Path::new("/usr/bin/governor").exists(), "purged");
}
