//! The `handoffs` binary: parse the command line, set up logging (stderr only), run the
//! command, and turn its outcome into one line on stderr and an exit code.

use clap::Parser;
use handoffs::front::cli::{self, Cli};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; anything else is a usage error.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HANDOFFS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match cli::run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if f.code != 130 || !f.message.is_empty() {
                eprintln!("handoffs: {}", f.message);
            }
            ExitCode::from(f.code)
        }
    }
}
