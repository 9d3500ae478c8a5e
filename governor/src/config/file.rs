//! Reading a configuration file: only a regular file of a configuration's
//! size is read, and a read that hangs (a file on a stalled network mount)
//! ends with an error after a while instead of holding up the agent.

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Larger than any configuration (4096 rules of a few lines each).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// How long a read of the configuration may take before it is given up.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The text of the configuration file at `path`. A FIFO, a device, a
/// directory or a socket is refused (opened without blocking, so a FIFO
/// with no writer does not hang the caller), as is a file over
/// [`MAX_CONFIG_BYTES`] or text that is not UTF-8.
pub fn read(path: &Path) -> io::Result<String> {
    read_regular(path, "configuration file", MAX_CONFIG_BYTES)
}

/// The text of `path` if it is a regular file of at most `max` bytes (a
/// `what`, as errors name it), opened without blocking.
pub fn read_regular(path: &Path, what: &str, max: u64) -> io::Result<String> {
    let mut file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        let ft = meta.file_type();
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_block_device() || ft.is_char_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{kind}, not a {what}")));
    }
    if meta.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} bytes, more than a {what}'s {} MiB", meta.len(), max >> 20),
        ));
    }
    let mut text = String::new();
    file.by_ref().take(max + 1).read_to_string(&mut text)?;
    Ok(text)
}

/// [`read`] on a thread of its own, given up after `timeout`: the caller
/// goes on whatever the file system does (the thread ends when the read
/// does).
pub fn read_within(path: &Path, timeout: Duration) -> io::Result<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let owned: PathBuf = path.to_path_buf();
    std::thread::Builder::new().name("governor-config-read".into()).spawn(move || {
        let _ = tx.send(read(&owned));
    })?;
    rx.recv_timeout(timeout).unwrap_or_else(|_| {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the read took more than {} s (a stalled file system?)", timeout.as_secs()),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_regular_file_of_a_configurations_size_is_read() {
        let dir = std::env::temp_dir().join(format!("governor-config-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("ok.toml");
        std::fs::write(&ok, "[agent]\n").unwrap();
        assert_eq!(read(&ok).unwrap(), "[agent]\n");
        assert!(read(&dir).unwrap_err().to_string().contains("a directory"));
        // A FIFO with no writer: refused at once, not waited on.
        let fifo = dir.join("fifo.toml");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let t0 = std::time::Instant::now();
        let e = read_within(&fifo, Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1));
        let big = dir.join("big.toml");
        std::fs::File::create(&big).unwrap().set_len(MAX_CONFIG_BYTES + 1).unwrap();
        assert!(read(&big).unwrap_err().to_string().contains("more than a configuration file's 16 MiB"));
        assert_eq!(read(&dir.join("absent.toml")).unwrap_err().kind(), io::ErrorKind::NotFound);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
