//! `aip`: the broker in one process, a reference device, and the commands to dispatch tasks and
//! look at tasks and agents. Everything is in the library; this only parses and runs.

use std::process::ExitCode;

fn main() -> ExitCode {
    aip_runtime::install_crypto_provider();
    let cli = aip::cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(aip::exit::ERROR);
        }
    };
    runtime.block_on(aip::run(cli))
}
