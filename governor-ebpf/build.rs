//! Fails early with a clear message when bpf-linker is missing, instead of a
//! linker error deep inside the BPF build. `cargo xtask setup` installs it.
fn main() {
    if which::which("bpf-linker").is_err() {
        panic!("bpf-linker is not installed: run `cargo xtask setup`");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
