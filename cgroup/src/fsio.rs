//! Reading and writing cgroup control files, telling "the cgroup is gone" from other failures.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::Path;

use super::CgroupError;

/// Reads the control file `name` of the cgroup directory `dir`.
pub(super) fn read(dir: &Path, name: &str) -> Result<String, CgroupError> {
    let file = dir.join(name);
    std::fs::read_to_string(&file).map_err(|e| classify(dir, &file, e))
}

/// Writes `value` to the control file `name` of the cgroup directory `dir`, in one `write(2)`:
/// cgroup files act on each write, so a value split across two writes would be two requests.
pub(super) fn write(dir: &Path, name: &str, value: &str) -> Result<(), CgroupError> {
    let file = dir.join(name);
    let result = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&file)
        .and_then(|mut f| f.write(value.as_bytes()));
    match result {
        Ok(n) if n == value.len() => Ok(()),
        Ok(n) => Err(CgroupError::Io {
            path: file,
            source: io::Error::new(
                io::ErrorKind::WriteZero,
                format!("wrote {n} of the {} bytes of {value:?}", value.len()),
            ),
        }),
        Err(e) => Err(classify(dir, &file, e)),
    }
}

/// Turns an I/O error on `file` (inside the cgroup directory `dir`) into [`CgroupError::Gone`] when
/// it means the directory was removed, else into [`CgroupError::Io`] naming the file.
///
/// The kernel answers ENODEV for a file of a cgroup removed while it was open, and ENOENT once
/// the directory is gone. ENOENT inside a directory that still exists is a missing control file
/// (an old kernel without `cgroup.freeze`, say), which is a real error.
pub(super) fn classify(dir: &Path, file: &Path, error: io::Error) -> CgroupError {
    match error.raw_os_error() {
        Some(libc::ENODEV) => CgroupError::Gone(dir.to_path_buf()),
        Some(libc::ENOENT) if !dir.exists() => CgroupError::Gone(dir.to_path_buf()),
        _ => CgroupError::Io {
            path: file.to_path_buf(),
            source: error,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_replaces_the_whole_value() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("freezer.state"), "FREEZING\n").unwrap();
        write(dir.path(), "freezer.state", "THAWED").unwrap();
        assert_eq!(read(dir.path(), "freezer.state").unwrap(), "THAWED");
    }

    #[test]
    fn missing_directory_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let cgroup = dir.path().join("web");
        assert!(matches!(
            read(&cgroup, "cgroup.procs"),
            Err(CgroupError::Gone(p)) if p == cgroup
        ));
        assert!(matches!(
            write(&cgroup, "freezer.state", "FROZEN"),
            Err(CgroupError::Gone(p)) if p == cgroup
        ));
    }

    #[test]
    fn missing_file_in_an_existing_directory_is_an_io_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        match write(dir.path(), "cgroup.freeze", "1") {
            Err(CgroupError::Io { path, .. }) => assert_eq!(path, dir.path().join("cgroup.freeze")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn enodev_is_gone_even_if_the_directory_exists() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cgroup.events");
        let error = classify(
            dir.path(),
            &file,
            io::Error::from_raw_os_error(libc::ENODEV),
        );
        assert!(matches!(error, CgroupError::Gone(p) if p == dir.path()));
    }
}
