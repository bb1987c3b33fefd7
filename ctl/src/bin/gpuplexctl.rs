//! `gpuplexctl`: look at and drive this node's gpuplex service (see `gpuplexctl --help`).

fn main() -> std::process::ExitCode {
    gpuplex_ctl::main()
}
